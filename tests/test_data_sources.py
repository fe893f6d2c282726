import json
import logging
from pathlib import Path

import pytest

from megatron_specdec.data import DataError, PRESETS, read_source, read_sources
from megatron_specdec.data.sources import SourceSpec, parse_source

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "sources"


def test_presets_read_the_shipped_files():
    counts = {name: len(read_source(name, DATA_DIR, on_error="fail")) for name in PRESETS}
    assert counts == {
        "gsm8k": 7473,
        "self_instruct_seed": 175,
        "self_instruct_user": 252,
        "mt_bench": 80,
    }


def test_preset_prompts_follow_the_field_mapping():
    raw = [json.loads(line) for line in open(DATA_DIR / "self_instruct_seed_tasks.jsonl")]
    rows = read_source("self_instruct_seed", DATA_DIR)
    assert [r.id for r in rows[:2]] == ["self_instruct_seed:1", "self_instruct_seed:2"]
    for row, src in zip(rows, raw):
        instruction, extra = src["instruction"].strip(), src["instances"][0]["input"].strip()
        assert row.turns == ((f"{instruction}\n\n{extra}" if extra else instruction),)
    assert any(not r["instances"][0]["input"].strip() for r in raw)  # both cases covered

    gsm = read_source("gsm8k", DATA_DIR)[0]
    assert gsm.id == "gsm8k:1" and gsm.turns[0].startswith("Natalia sold clips")

    mt = read_source("mt_bench", DATA_DIR)
    assert all(len(r.turns) == 2 for r in mt) and PRESETS["mt_bench"].split == "eval"
    assert mt[0].meta == {"question_id": 81, "category": "writing"}


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


BAD_FILE = [
    '{"q": "good one"}',
    '{"q": "broken"',
    "",
    '{"other": 1}',
    '{"q": 7}',
    '{"q": "   "}',
    "[1, 2]",
    '{"q": "good two"}',
]


def test_bad_rows_are_skipped_with_file_and_line(tmp_path, caplog):
    path = _write(tmp_path / "p.jsonl", BAD_FILE)
    spec = SourceSpec("mine", str(path), prompt="q")
    with caplog.at_level(logging.WARNING):
        rows = read_source(spec)
    assert [(r.id, r.turns) for r in rows] == [("mine:1", ("good one",)), ("mine:8", ("good two",))]
    text = caplog.text
    for lineno, reason in [
        (2, "invalid JSON"),
        (4, "missing field 'q'"),
        (5, "field 'q' must be a string"),
        (6, "empty prompt"),
        (7, "expected a JSON object"),
    ]:
        assert f"{path}:{lineno}: {reason}" in text
    assert "skipped 5 bad row(s)" in text


def test_bad_rows_are_fatal_when_configured(tmp_path):
    path = _write(tmp_path / "p.jsonl", BAD_FILE)
    with pytest.raises(DataError, match=rf"{path}:2: invalid JSON"):
        read_source(SourceSpec("mine", str(path), prompt="q"), on_error="fail")
    with pytest.raises(DataError, match="on_error"):
        read_source(SourceSpec("mine", str(path), prompt="q"), on_error="ignore")


def test_custom_spec_dotted_fields_and_turns(tmp_path):
    path = _write(
        tmp_path / "c.jsonl",
        [
            json.dumps({"task": {"text": "Sum"}, "inputs": [{"x": "1 2"}], "k": 3}),
            json.dumps({"task": {"text": "Hi"}, "inputs": []}),
            json.dumps({"task": {"text": "Bad"}, "inputs": [{"x": 5}]}),
        ],
    )
    spec = parse_source(
        json.dumps(
            {
                "name": "c",
                "file": "c.jsonl",
                "prompt": "task.text",
                "context": "inputs.0.x",
                "meta": ["k"],
            }
        )
    )
    rows = read_source(spec, tmp_path)
    assert [(r.turns, r.meta) for r in rows] == [(("Sum\n\n1 2",), {"k": 3}), (("Hi",), {})]

    multi = _write(tmp_path / "m.jsonl", ['{"t": ["a", "b"]}', '{"t": ["a", 3]}', '{"t": []}'])
    rows = read_source({"name": "m", "file": str(multi), "turns": "t"})
    assert [r.turns for r in rows] == [("a", "b")]


def test_spec_and_set_errors(tmp_path):
    with pytest.raises(DataError, match="exactly one"):
        SourceSpec("x", "x.jsonl")
    with pytest.raises(DataError, match="unknown source 'nope'"):
        parse_source("nope")
    with pytest.raises(DataError, match="data dir"):
        read_source("gsm8k")
    with pytest.raises(DataError, match="does not exist"):
        read_source("gsm8k", tmp_path)
    with pytest.raises(DataError, match="distinct"):
        read_sources(["gsm8k", "gsm8k"], tmp_path)

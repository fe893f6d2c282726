"""Requests about a given text (`python -m megatron_specdec.cli.data ground`): passages are cut at a
paragraph or sentence end, every prompt holds its passage whole inside one of the requests,
the draw is fixed by the seed, and bad requests files or settings fail naming the file, line
or flag."""

import json

import pytest

from megatron_specdec.data import grounded
from megatron_specdec.cli.data import main
from megatron_specdec.data.jsonl import DataError


def _conversations(path, answers):
    path.write_text("".join(json.dumps({"id": f"r{i}", "conversations": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": a}]}) + "\n"
        for i, a in enumerate(answers)))
    return path


def test_cut_ends_at_a_paragraph_then_a_sentence_or_gives_nothing():
    assert grounded.cut("short.", 100) == "short."
    text = "A" * 60 + ".\n\n" + "B" * 30 + ". " + "C" * 50
    assert grounded.cut(text, 100) == "A" * 60 + "."  # the paragraph break wins
    assert grounded.cut("A" * 60 + ". " + "B" * 80, 100) == "A" * 60 + "."
    assert grounded.cut("A" * 30 + ". " + "B" * 80, 100) == ""  # no end in the second half


def test_prompts_hold_their_passage_whole_and_follow_the_seed(tmp_path):
    answers = [f"Passage {i} says {'x' * (20 + i)}." for i in range(12)] + ["tiny."]
    conv = _conversations(tmp_path / "c.jsonl", answers + answers[:3])  # repeats count once
    requests_file = tmp_path / "r.txt"
    requests_file.write_text("# comment\nList the facts:\\n\\n{text}\n\n{text}\\nSummarize it.\n")
    requests = grounded.read_instructions(requests_file)
    assert requests == ["List the facts:\n\n{text}", "{text}\nSummarize it."]
    passages = grounded.read_passages([conv], min_chars=20, max_chars=200)
    assert passages == answers[:12]  # distinct, in file order, the short one left out
    rows = grounded.grounded_prompts(passages, requests, 8, seed=3)
    assert rows == grounded.grounded_prompts(passages, requests, 8, seed=3)
    assert rows != grounded.grounded_prompts(passages, requests, 8, seed=4)
    used = []
    for row in rows:
        passage = next(p for p in passages if p in row["prompt"])
        assert row["prompt"] in [r.replace("{text}", passage) for r in requests]
        used.append(passage)
    assert len(set(used)) == 8 and len({r["id"] for r in rows}) == 8
    with pytest.raises(DataError, match="--num-prompts 13: only 12 passages"):
        grounded.grounded_prompts(passages, requests, 13, seed=3)


def test_bad_requests_and_settings_name_the_file_line_or_flag(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("# c\nNo placeholder here\n")
    with pytest.raises(DataError, match=r"bad.txt:2: a request needs \{text\} exactly once"):
        grounded.read_instructions(bad)
    bad.write_text("# only comments\n")
    with pytest.raises(DataError, match="no requests"):
        grounded.read_instructions(bad)
    with pytest.raises(DataError, match="--instructions .*missing.txt"):
        grounded.read_instructions(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="--min-chars <= --max-chars"):
        grounded.read_passages([], min_chars=50, max_chars=10)


def test_cli_writes_the_prompts(tmp_path):
    conv = _conversations(tmp_path / "c.jsonl", [f"Answer number {i} is long enough." for i in range(5)])
    requests = tmp_path / "r.txt"
    requests.write_text("Extract the numbers:\\n\\n{text}\n")
    out = tmp_path / "out" / "g.jsonl"
    main(["ground", "--conversations", str(conv), "--instructions", str(requests),
          "--num-prompts", "4", "--seed", "1", "--min-chars", "10", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(r["prompt"].startswith("Extract the numbers:\n\n") for r in rows)
    assert [p.name for p in out.parent.iterdir()] == ["g.jsonl"]  # no temporary file left

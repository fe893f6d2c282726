"""Task prompts (data/tasks.py): deterministic, every kind, held-out documents apart from
training ones, long documents within their token range, bad input refused by name."""

import gzip
import json
import logging
import shutil
from pathlib import Path

import pytest

from megatron_specdec.cli.data import main
from megatron_specdec.data import tasks
from megatron_specdec.data.conversations import load_tokenizer
from megatron_specdec.data.jsonl import DataError

REPO = Path(__file__).resolve().parents[1]
MODULES = ("fnmatch.py", "textwrap.py", "shlex.py", "glob.py", "bisect.py", "heapq.py",
           "calendar.py", "csv.py", "difflib.py", "string.py", "json/decoder.py",
           "json/encoder.py", "gzip.py", "tempfile.py")
LONG = (1000, 2000)


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory):
    """A small stdlib: the real topics and text files and a few real modules."""
    real = tasks.stdlib_dir()
    root = tmp_path_factory.mktemp("stdlib")
    for rel in (tasks.TOPICS_PATH,) + tasks.TEXT_PATHS + MODULES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(real / rel, root / rel)
    return root


@pytest.fixture(scope="module")
def count():
    tokenizer = load_tokenizer("default")
    return lambda text: len(tokenizer.encode(text))


@pytest.fixture(scope="module")
def built(stdlib, count):
    return tasks.build_tasks(stdlib, count, train_per_kind=40, heldout_per_kind=4, seed=3,
                             long_tokens=LONG)


def test_deterministic_in_seed(stdlib, count, built):
    again = tasks.build_tasks(stdlib, count, train_per_kind=40, heldout_per_kind=4, seed=3,
                              long_tokens=LONG)
    assert again == built
    other = tasks.build_tasks(stdlib, count, train_per_kind=40, heldout_per_kind=4, seed=4,
                              long_tokens=LONG)
    assert [r.prompt for r in other[0]] != [r.prompt for r in built[0]]


def test_every_kind_in_both_splits(built):
    train, heldout = built
    assert {r.kind for r in train} == set(tasks.KINDS)
    assert sorted(r.kind for r in heldout) == sorted(tasks.KINDS * 4)
    assert all(r.licence == tasks.LICENCE and r.path and r.package.startswith("cpython-")
               for r in train + heldout)


def test_heldout_documents_not_in_train(built):
    train, heldout = built
    assert {r.document for r in train}.isdisjoint({r.document for r in heldout})


def test_long_documents_within_token_range(built, count):
    longs = [r for r in built[0] + built[1] if r.kind == "summarize_long"]
    # The document is all of the prompt but the request around it (under 60 tokens).
    assert longs and all(LONG[0] <= count(r.prompt) <= LONG[1] + 60 for r in longs)


def test_long_chunks_cut_at_paragraphs(count):
    text = "\n\n".join(f"Paragraph {i} says something about item {i}. " * 12 for i in range(60))
    chunks = tasks.long_chunks(text, count, 300, 500)
    assert len(chunks) >= 5
    assert all(300 <= count(c) <= 500 and c.startswith("Paragraph") for c in chunks)


def test_committed_splits_apart():
    def rows(path):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f]
    train = rows(REPO / "data" / "smollm2_task_prompts.jsonl.gz")
    train += rows(REPO / "data" / "smollm2_task_prompts_long.jsonl.gz")
    heldout = rows(REPO / "data" / "smollm2_tasks_heldout.jsonl")
    assert {r["kind"] for r in train} == {r["kind"] for r in heldout} == set(tasks.KINDS)
    assert {r["document"] for r in train}.isdisjoint({r["document"] for r in heldout})


def test_long_out_takes_the_long_documents(stdlib, tmp_path):
    out, long_out, heldout = tmp_path / "t.jsonl.gz", tmp_path / "l.jsonl.gz", tmp_path / "h.jsonl"
    assert main(["tasks", "--stdlib", str(stdlib), "--train-per-kind", "10",
                 "--heldout-per-kind", "2", "--out", str(out), "--long-out", str(long_out),
                 "--heldout-out", str(heldout)]) == 0
    kinds = [json.loads(line)["kind"] for line in gzip.open(out, "rt", encoding="utf-8")]
    long_kinds = [json.loads(line)["kind"] for line in gzip.open(long_out, "rt", encoding="utf-8")]
    assert sorted(set(kinds)) == sorted(set(tasks.KINDS) - {"summarize_long"}) and len(kinds) == 40
    assert long_kinds == ["summarize_long"] * 10
    held = [json.loads(line)["category"] for line in open(heldout, encoding="utf-8")]
    assert held == list(tasks.KINDS) * 2


def test_unknown_kind_refused_in_one_line(tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        rc = main(["tasks", "--kinds", "code,poetry", "--out", str(tmp_path / "t.jsonl"),
                   "--heldout-out", str(tmp_path / "h.jsonl")])
    assert rc == 1
    assert "--kinds: unknown kind 'poetry'" in caplog.text and "\n" not in caplog.text.strip()
    assert not (tmp_path / "t.jsonl").exists()


def test_missing_source_refused_by_name(stdlib, tmp_path, caplog):
    root = tmp_path / "stdlib"
    shutil.copytree(stdlib, root)
    (root / "idlelib" / "NEWS.txt").unlink()
    with pytest.raises(DataError, match="missing source idlelib/NEWS.txt"):
        tasks.stdlib_dir(str(root))
    with caplog.at_level(logging.ERROR):
        rc = main(["tasks", "--stdlib", str(root), "--out", str(tmp_path / "t.jsonl"),
                   "--heldout-out", str(tmp_path / "h.jsonl")])
    assert rc == 1 and "missing source idlelib/NEWS.txt" in caplog.text

"""The regeneration driver: sharding, kill-and-resume, multi-turn. The backend here is a
deterministic stand-in (it tests the driver, not a model); tokenization is SmolLM2's."""

import json

import pytest

from megatron_specdec.data import (
    DataError,
    PromptRow,
    load_tokenizer,
    read_conversations,
    regenerate,
    select_shard,
    shard_output_path,
)
from megatron_specdec.data.jsonl import DurableJsonlWriter

EOS = 2


class EchoBackend:
    """Answers with the last 6 non-special prompt tokens reversed, then eos (or no eos when the prompt length is
    odd, as if max_new_tokens were hit). Raises `Killed` once `kill_after` prompts were answered."""

    def __init__(self, kill_after=None):
        self.kill_after = kill_after
        self.prompts = []

    def generate(self, prompts, max_new_tokens, messages=None):
        assert len(messages) == len(prompts)
        if self.kill_after is not None and len(self.prompts) + len(prompts) > self.kill_after:
            raise Killed
        self.prompts += prompts
        return [
            [t for t in p if t > EOS][-6:][::-1] + ([EOS] if len(p) % 2 == 0 else [])
            for p in prompts
        ]


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


ROWS = [PromptRow(f"s:{i}", "s", (f"Question number {i}?",)) for i in range(1, 30)] + [
    PromptRow("m:1", "m", ("First turn.", "Second turn, please."), {"category": "x"})
]


def _lines(path):
    return path.read_text().splitlines()


@pytest.fixture(scope="module")
def reference(tokenizer, module_tmp):
    path = module_tmp("ref") / "regen.jsonl"
    stats = regenerate(ROWS, EchoBackend(), tokenizer, path, batch_size=4, progress=False)
    assert (stats.written, stats.already_done) == (len(ROWS), 0)
    return _lines(path)


def test_rows_are_conversations_in_order(reference, tokenizer):
    rows = [json.loads(line) for line in reference]
    assert [r["id"] for r in rows] == [r.id for r in ROWS]
    first = rows[0]
    assert first["source"] == "s" and [m["role"] for m in first["conversations"]] == [
        "user",
        "assistant",
    ]
    assert first["conversations"][0]["content"] == "Question number 1?"
    assert set(r["finish_reasons"][0] for r in rows) == {"stop", "length"}
    multi = rows[-1]
    assert [m["role"] for m in multi["conversations"]] == ["user", "assistant"] * 2
    assert multi["meta"] == {"category": "x"} and len(multi["finish_reasons"]) == 2


def test_second_turn_sees_the_first_answer(tokenizer, tmp_path):
    backend = EchoBackend()
    regenerate(ROWS[-1:], backend, tokenizer, tmp_path / "o.jsonl", progress=False)
    row = json.loads(_lines(tmp_path / "o.jsonl")[0])
    second_prompt = tokenizer.decode(backend.prompts[1])
    assert row["conversations"][1]["content"] in second_prompt and second_prompt.endswith(
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("kill_after", [0, 5, 13])
def test_kill_after_k_rows_then_resume_matches(reference, tokenizer, tmp_path, kill_after):
    path = tmp_path / "regen.jsonl"
    with pytest.raises(Killed):
        regenerate(ROWS, EchoBackend(kill_after), tokenizer, path, batch_size=4, progress=False)
    assert _lines(path) == reference[: kill_after // 4 * 4]  # whole batches were written
    stats = regenerate(ROWS, EchoBackend(), tokenizer, path, batch_size=3, progress=False)
    assert stats.already_done == kill_after // 4 * 4
    assert _lines(path) == reference


def test_truncated_last_line_is_repaired_on_resume(reference, tokenizer, tmp_path):
    path = tmp_path / "regen.jsonl"
    path.write_text("\n".join(reference[:7]) + "\n" + reference[7][: len(reference[7]) // 2])
    regenerate(ROWS, EchoBackend(), tokenizer, path, batch_size=5, progress=False)
    assert _lines(path) == reference
    # A second run finds everything done and changes nothing.
    backend = EchoBackend()
    assert regenerate(ROWS, backend, tokenizer, path, progress=False).written == 0
    assert backend.prompts == [] and _lines(path) == reference


def test_corrupt_complete_line_is_an_error(reference, tokenizer, tmp_path):
    path = tmp_path / "regen.jsonl"
    path.write_text(reference[0] + "\n{oops\n" + reference[2] + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: corrupt row"):
        regenerate(ROWS, EchoBackend(), tokenizer, path, progress=False)


def test_shards_cover_every_row_once(reference, tokenizer, tmp_path):
    shards = [select_shard(ROWS, i, 3) for i in range(3)]
    ids = [r.id for shard in shards for r in shard]
    assert sorted(ids) == sorted(r.id for r in ROWS) and all(shards)
    assert select_shard(ROWS, 1, 3) == shards[1]  # deterministic
    paths = [shard_output_path(tmp_path / "regen.jsonl", i, 3) for i in range(3)]
    assert paths[1].name == "regen.shard00001-of-00003.jsonl"
    for shard, path in zip(shards, paths):
        regenerate(shard, EchoBackend(), tokenizer, path, batch_size=4, progress=False)
    merged = {r["id"]: r for r in read_conversations(paths, on_error="fail")}
    assert merged == {r["id"]: r for r in map(json.loads, reference)}
    with pytest.raises(DataError, match="shard-index"):
        select_shard(ROWS, 3, 3)


def test_limit_takes_a_prefix_of_the_shard_order():
    full = select_shard(ROWS, 0, 1)
    assert select_shard(ROWS, 0, 1, limit=5) == full[:5]
    assert {r.id for r in full} == {r.id for r in ROWS}


def test_eval_sources_are_refused(tokenizer, tmp_path):
    with pytest.raises(DataError, match="evaluation-only"):
        regenerate(
            [PromptRow("mt_bench:1", "mt_bench", ("q",))],
            EchoBackend(),
            tokenizer,
            tmp_path / "o.jsonl",
        )


def test_one_writer_per_file(tmp_path):
    path = tmp_path / "o.jsonl"
    with DurableJsonlWriter(path):
        with pytest.raises(DataError, match="another process"):
            DurableJsonlWriter(path)

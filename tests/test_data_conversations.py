import json
import logging

import pytest

from megatron_specdec.data import (
    DataError,
    end_of_turn_ids,
    load_tokenizer,
    read_conversations,
    tokenize_conversation,
)

EOS = 2  # <|im_end|>, SmolLM2's end of turn


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "  It is 4.\nDone"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
]


def _masked_runs(sample):
    """Contiguous runs of loss-masked token ids."""
    runs, run = [], []
    for token, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            run.append(token)
        elif run:
            runs, run = runs + [run], []
    return runs + ([run] if run else [])


def test_end_of_turn_is_im_end(tokenizer):
    assert end_of_turn_ids(tokenizer) == {EOS}


def test_loss_mask_covers_exactly_the_assistant_replies(tokenizer):
    sample = tokenize_conversation(tokenizer, CHAT)
    assert len(sample.input_ids) == len(sample.loss_mask)
    # The token sequence spells the chat-templated conversation (system prompt included).
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer.decode(sample.input_ids) == text
    runs = _masked_runs(sample)
    assert [tokenizer.decode(r) for r in runs] == ["  It is 4.\nDone<|im_end|>", "6<|im_end|>"]
    assert all(r[-1] == EOS for r in runs)
    # Each reply is tokenized as generated: its ids equal the reply tokenized on its own.
    assert runs[1] == tokenizer("6", add_special_tokens=False)["input_ids"] + [EOS]
    # The newline after <|im_end|> is template glue, never generated: unmasked.
    last = max(i for i, m in enumerate(sample.loss_mask) if m)
    assert sample.input_ids[last] == EOS and sample.loss_mask[last + 1 :] == [0]


def test_system_message_and_truncation(tokenizer):
    chat = [{"role": "system", "content": "Be brief."}] + CHAT[:2]
    full = tokenize_conversation(tokenizer, chat)
    assert "Be brief." in tokenizer.decode(full.input_ids)
    assert [tokenizer.decode(r) for r in _masked_runs(full)] == ["  It is 4.\nDone<|im_end|>"]
    first = full.loss_mask.index(1)
    cut = tokenize_conversation(tokenizer, chat, max_length=first + 2)
    assert (
        cut.input_ids == full.input_ids[: first + 2]
        and cut.loss_mask == full.loss_mask[: first + 2]
    )
    assert cut.num_loss_tokens == 2


def test_non_incremental_template_is_refused(tokenizer):
    class Reversing:
        """A template whose rendering of earlier turns changes as turns are added."""

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return "".join(m["content"] for m in reversed(messages)) + (
                "|" if add_generation_prompt else ""
            )

    with pytest.raises(DataError, match="incrementally"):
        tokenize_conversation(Reversing(), CHAT, eos_ids={EOS})


def test_read_conversations_validates_and_dedupes(tmp_path, caplog):
    good = {"id": "a", "source": "s", "conversations": CHAT[:2]}
    lines = [
        json.dumps(good),
        json.dumps({"id": "b", "conversations": [{"role": "assistant", "content": "x"}]}),
        json.dumps({"id": "c", "conversations": [CHAT[0]]}),
        json.dumps({"conversations": CHAT[:2]}),
        json.dumps({"id": "d", "conversations": [{"role": "user", "content": 1}]}),
        json.dumps(good),
        json.dumps({**good, "id": "e"}),
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        rows = read_conversations(path)
    assert [r["id"] for r in rows] == ["a", "e"]
    for lineno, reason in [
        (2, "alternate"),
        (3, "no assistant"),
        (4, "'id'"),
        (5, "string 'content'"),
    ]:
        assert f"{path}:{lineno}" in caplog.text and reason in caplog.text
    assert f"{path}: 1 row(s) repeat an earlier id and were skipped, keeping the first (lines 6 ('a'))" \
        in caplog.text
    with pytest.raises(DataError, match=rf"{path}:2: roles must alternate"):
        read_conversations([path], on_error="fail")


def test_gzip_files_read_like_plain_ones(tmp_path):
    import gzip

    lines = [json.dumps({"id": "a", "conversations": CHAT[:2]}), "{not json",
             json.dumps({"id": "b", "conversations": CHAT})]
    plain, packed = tmp_path / "c.jsonl", tmp_path / "c.jsonl.gz"
    plain.write_text("\n".join(lines) + "\n")
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    assert read_conversations(packed) == read_conversations(plain)
    with pytest.raises(DataError, match=rf"{packed}:2: invalid JSON"):
        read_conversations([packed], on_error="fail")


def test_committed_regenerated_dataset_is_readable():
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "data" / "smollm2_regen.jsonl.gz"
    rows = read_conversations([path], on_error="fail")
    assert len(rows) == 4320
    assert all(r["conversations"][-1]["role"] == "assistant" for r in rows)
    general = read_conversations([path.with_name("smollm2_regen_general.jsonl.gz")], on_error="fail")
    assert len(general) == 7070
    assert {r["source"] for r in general} == {"self_instruct_user", "self_instruct_seed", "synth"}
    assert not {r["id"] for r in general} & {r["id"] for r in rows}

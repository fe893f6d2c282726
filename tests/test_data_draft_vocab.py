import json

import pytest
import torch

from megatron_specdec.data import (
    DataError,
    DraftVocab,
    TokenizedConversation,
    build_draft_vocab,
    calibrate,
    count_tokens,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def test_top_n_by_count_ties_to_lower_id_sorted_by_id():
    counts = torch.tensor([5, 0, 9, 5, 5, 1, 9, 0])
    vocab = build_draft_vocab(counts, 4)
    assert vocab.target_ids.tolist() == [0, 2, 3, 6]  # 9, 9, then the two lowest ids with 5
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [0, 1, 1, 3]
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.nonzero().flatten().tolist() == [0, 2, 3, 6]
    logits = torch.randn(2, 8)
    assert torch.equal(logits[:, vocab.t2d], logits[:, vocab.target_ids])  # draft-id order


def test_end_of_turn_ids_are_always_included():
    counts = torch.tensor([5, 0, 9, 5, 5, 1, 9, 0])
    vocab = build_draft_vocab(counts, 4, always_include={7})
    assert vocab.target_ids.tolist() == [0, 2, 6, 7]


@pytest.mark.parametrize("size", [0, -3, 9])
def test_bad_sizes_name_the_flag(size):
    with pytest.raises(DataError, match="--draft-vocab-size"):
        build_draft_vocab(torch.ones(8, dtype=torch.int64), size)


def test_count_tokens_assistant_only_or_all():
    samples = [
        TokenizedConversation([1, 2, 3, 3], [0, 0, 1, 1]),
        TokenizedConversation([2, 4], [0, 1]),
    ]
    assert count_tokens(samples, 5).tolist() == [0, 0, 0, 2, 1]
    assert count_tokens(samples, 5, assistant_only=False).tolist() == [0, 1, 2, 2, 1]
    with pytest.raises(DataError, match="vocab size 4"):
        count_tokens(samples, 4)


def test_save_load_roundtrip(tmp_path):
    vocab = build_draft_vocab(torch.arange(10), 3, always_include={0})
    vocab.save(tmp_path / "d2t.safetensors", {"draft_vocab_size": 3})
    back = DraftVocab.load(tmp_path / "d2t.safetensors")
    for name in ("d2t", "t2d", "counts"):
        assert torch.equal(getattr(back, name), getattr(vocab, name))
    assert (back.draft_vocab_size, back.vocab_size) == (3, 10)
    with pytest.raises(DataError, match="not a draft vocabulary"):
        DraftVocab.load(tmp_path / "missing.safetensors")


def test_calibrate_on_conversations_with_the_real_tokenizer(tmp_path, tokenizer):
    answers = ["the cat sat on the mat", "the dog sat", "a cat and the dog"]
    path = tmp_path / "c.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": str(i),
                    "conversations": [
                        {"role": "user", "content": "Tell me about pets"},
                        {"role": "assistant", "content": a},
                    ],
                }
            )
            + "\n"
            for i, a in enumerate(answers)
        )
    )
    vocab = calibrate(path, tokenizer, draft_vocab_size=4)
    assert vocab.vocab_size == 49152 and vocab.draft_vocab_size == 4
    the, sat = (tokenizer(w, add_special_tokens=False)["input_ids"][-1] for w in (" the", " sat"))
    assert set(vocab.target_ids.tolist()) >= {tokenizer.eos_token_id, the, sat}
    assert vocab.counts[tokenizer.eos_token_id] == 3  # one end of turn per reply
    user_only = tokenizer(" pets", add_special_tokens=False)["input_ids"][-1]
    assert vocab.counts[user_only] == 0
    assert calibrate(path, tokenizer, 4, assistant_only=False).counts[user_only] == 3


def test_calibration_without_usable_rows_names_the_file(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x", "conversations": []}\nnot json\n')
    with pytest.raises(
        DataError, match=f"no usable conversation rows in calibration data.*{path.name}"
    ):
        calibrate(path, tokenizer, 8)
    with pytest.raises(DataError, match="does not exist"):
        calibrate(tmp_path / "nope.jsonl", tokenizer, 8)

import json

import pytest
import torch

from megatron_specdec.data import (
    BatchIterator,
    ConversationDataset,
    DataError,
    TokenizedConversation,
    load_tokenizer,
    packed_attention_mask,
    packed_seq_params,
    packed_seq_params_of_mask,
)

PAD = 0


def _samples(n=23, seed=0):
    """Synthetic tokenized conversations: id pattern encodes (sample, position)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 15, (1,), generator=g))
        prompt = int(torch.randint(1, length // 2 + 1, (1,), generator=g))
        out.append(
            TokenizedConversation(
                [1000 * (i + 1) + t for t in range(length)], [0] * prompt + [1] * (length - prompt)
            )
        )
    return out


def _conversation_of(token):
    return token // 1000 - 1


def test_padded_rows_have_fixed_shapes():
    samples = _samples()
    ds = ConversationDataset(samples, seq_length=12, pad_id=PAD)
    assert len(ds) == len(samples)
    for i, s in enumerate(samples):
        row = ds[i]
        assert {k: (v.shape, v.dtype) for k, v in row.items()} == {
            "input_ids": ((12,), torch.long),
            "loss_mask": ((12,), torch.float32),
            "position_ids": ((12,), torch.long),
            "segment_ids": ((12,), torch.long),
        }
        n = min(len(s.input_ids), 12)
        assert row["input_ids"][:n].tolist() == s.input_ids[:n]
        assert row["loss_mask"].tolist() == s.loss_mask[:n] + [0.0] * (12 - n)
        assert (row["input_ids"][n:] == PAD).all() and row["segment_ids"].tolist() == [1] * n + [
            0
        ] * (12 - n)
        assert row["position_ids"].tolist() == list(range(n)) + list(range(12 - n))


def test_packing_keeps_every_conversation_whole_once():
    samples = _samples(40)
    ds = ConversationDataset(samples, seq_length=32, pad_id=PAD, pack=True, seed=3)
    assert len(ds) < len(samples)
    seen = []
    for i in range(len(ds)):
        row = ds[i]
        for seg in row["segment_ids"].unique().tolist():
            where = (row["segment_ids"] == seg).nonzero().flatten()
            ids = row["input_ids"][where].tolist()
            if seg == 0:
                assert set(ids) == {PAD} and not row["loss_mask"][where].any()
                continue
            k = _conversation_of(ids[0])
            seen.append(k)
            assert ids == samples[k].input_ids  # whole, contiguous
            assert row["loss_mask"][where].tolist() == samples[k].loss_mask
            assert row["position_ids"][where].tolist() == list(
                range(len(ids))
            )  # reset per conversation
    assert sorted(seen) == list(range(len(samples)))
    # Packing is a function of the seed.
    again = ConversationDataset(samples, 32, PAD, pack=True, seed=3)
    assert (
        again.rows == ds.rows
        and ConversationDataset(samples, 32, PAD, pack=True, seed=4).rows != ds.rows
    )


def test_samples_without_assistant_tokens_in_window_are_dropped():
    samples = [
        TokenizedConversation([1, 2, 3, 4], [0, 0, 0, 1]),
        TokenizedConversation([1, 2], [0, 1]),
    ]
    assert len(ConversationDataset(samples, 3, PAD)) == 1
    with pytest.raises(DataError, match="no conversation"):
        ConversationDataset(samples[:1], 3, PAD)


def test_packed_attention_mask_is_causal_and_block_diagonal():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0]])
    allowed = ~packed_attention_mask(seg)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x) and len(a) == len(b)


def test_batches_are_deterministic_and_resume_exactly():
    ds = ConversationDataset(_samples(), 16, PAD)
    ref = _take(BatchIterator(ds, micro_batch_size=4, seed=7), 15)  # 60 samples: crosses two epochs
    assert all(b["input_ids"].shape == (4, 16) for b in ref)
    assert _same(ref, _take(BatchIterator(ds, 4, seed=7), 15))
    assert not _same(ref, _take(BatchIterator(ds, 4, seed=8), 15))
    # Each epoch visits every row once.
    firsts = [_conversation_of(int(t)) for b in ref for t in b["input_ids"][:, 0]]
    assert sorted(firsts[:23]) == list(range(23)) and sorted(firsts[23:46]) == list(range(23))
    # Resume from a checkpointed counter.
    it = BatchIterator(ds, 4, seed=7)
    _take(it, 6)
    assert it.consumed_samples == 24
    assert _same(
        ref[6:], _take(BatchIterator(ds, 4, seed=7, consumed_samples=it.consumed_samples), 9)
    )


def test_data_parallel_ranks_split_the_global_batch():
    ds = ConversationDataset(_samples(), 16, PAD)
    ref = _take(BatchIterator(ds, 6, seed=1), 5)
    ranks = [
        BatchIterator(ds, 2, seed=1, data_parallel_rank=r, data_parallel_size=3) for r in range(3)
    ]
    for step in range(5):
        parts = [next(it) for it in ranks]
        assert torch.equal(torch.cat([p["input_ids"] for p in parts]), ref[step]["input_ids"])
    assert ranks[0].consumed_samples == 30
    with pytest.raises(DataError, match="data_parallel_rank"):
        BatchIterator(ds, 2, data_parallel_rank=3, data_parallel_size=3)


def test_from_files_with_the_real_tokenizer(tmp_path):
    tokenizer = load_tokenizer("default")
    path = tmp_path / "c.jsonl"
    rows = [
        {
            "id": str(i),
            "conversations": [
                {"role": "user", "content": f"Count to {i}"},
                {"role": "assistant", "content": " ".join(map(str, range(i)))},
            ],
        }
        for i in range(1, 9)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = ConversationDataset.from_files(path, tokenizer, seq_length=128, pack=True)
    batch = next(BatchIterator(ds, 2))
    assert batch["input_ids"].shape == (2, 128)
    masked = batch["input_ids"][batch["loss_mask"].bool()]
    assert (masked == tokenizer.eos_token_id).sum() == (batch["segment_ids"].amax(1)).sum()


def _thd_allowed(cu_seqlens, n):
    """The causal block-diagonal attention over n flattened tokens that cu_seqlens describes."""
    doc = torch.zeros(n, dtype=torch.long)
    doc[cu_seqlens[1:-1].long()] = 1
    doc = doc.cumsum(0)
    return (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()


def test_packed_seq_params_pin_what_transformer_engine_receives():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1], [1, 2, 3, 0, 0, 0]])
    params = packed_seq_params(seg)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 2, 5, 6, 12, 13, 14, 15, 18]
    assert params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.max_seqlen_q == params.max_seqlen_kv == 6
    assert params.cu_seqlens_q_padded is None


def test_packed_seq_params_equal_the_packed_mask_on_packed_rows():
    seg = torch.stack([row["segment_ids"] for row in
                       ConversationDataset(_samples(), 32, PAD, pack=True, seed=3)])
    assert (seg.max(1).values > 1).any()  # some row holds several conversations
    allowed = _thd_allowed(packed_seq_params(seg).cu_seqlens_q, seg.numel())
    local = (~packed_attention_mask(seg)[:, 0]).int()
    assert torch.equal(allowed.int(), torch.block_diag(*local))
    # what the training forward hands TE's layers, read back from the mask it is given
    of_mask = packed_seq_params_of_mask(packed_attention_mask(seg))
    assert torch.equal(of_mask.cu_seqlens_q, packed_seq_params(seg).cu_seqlens_q)


def test_packed_seq_params_of_another_mask_are_refused():
    sees_all = torch.zeros(1, 1, 4, 4, dtype=torch.bool)  # True = may not attend: not causal
    with pytest.raises(ValueError, match="attention_mask: .*causal block-diagonal"):
        packed_seq_params_of_mask(sees_all)


"""A step's length: its last real position rounded up to data.length_bucket, never past the
rows' length, so a run sees at most seq_length / bucket shapes (oneDNN keeps bf16 kernels
per shape; bench/bench_soak.py measures the growth a new shape every step causes)."""

import torch

from megatron_specdec.training.batches import step_batches, step_length


def _row(real: int, length: int = 128) -> dict:
    seg = torch.zeros(1, length, dtype=torch.long)
    seg[0, :real] = 1
    return {"segment_ids": seg, "input_ids": torch.arange(length)[None],
            "loss_mask": (seg > 0).float()}


def test_rounded_up_to_the_bucket_over_all_micro_batches():
    assert step_length([_row(70), _row(10)], 64) == 128
    assert step_length([_row(64), _row(3)], 64) == 64
    assert step_length([_row(65)], 1) == 65  # 1: the exact length
    assert step_length([_row(100, length=100)], 64) == 100  # never past the rows


def test_distinct_shapes_bounded_by_the_bucket():
    lengths = {step_length([_row(n)], 32) for n in range(1, 129)}
    assert lengths == {32, 64, 96, 128}


def test_padding_added_by_the_bucket_is_not_scored():
    (batch,) = step_batches([_row(70)], pack=True, bucket=64)
    assert batch["input_ids"].shape == (1, 128)
    assert batch["loss_mask"][0, 70:].sum() == 0
    assert batch["attention_mask"].shape[-1] == 128

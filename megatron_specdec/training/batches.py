"""A data batch in the model's terms, shared by the trainer and the offline state dump (so
neither imports the other)."""

from megatron_specdec import distributed

# Stored base states an offline batch carries besides the tokens (see offline.py).
STATE_KEYS = ("aux", "residual")


def model_batch(batch: dict, pack: bool) -> dict:
    """The model's inputs on this rank's device: packed rows attend within their
    conversation."""
    from megatron_specdec.data import packed_attention_mask

    out = {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"]}
    if pack:
        out["attention_mask"] = packed_attention_mask(batch["segment_ids"])
    out.update({k: v for k, v in batch.items() if k in STATE_KEYS})
    return {k: v.to(distributed.device()) for k, v in out.items()}


def step_length(raw: list, bucket: int) -> int:
    """The positions a step computes: up to the last non-padding position of any micro-batch,
    rounded up to a multiple of `bucket` (at most the rows' length). Trailing padding changes
    nothing a real position computes (causal, positions count from the row start) but costs
    every layer; the rounding bounds the distinct shapes a run sees, because oneDNN (bf16
    matmuls on the CPU) keeps kernels and buffers per shape and a new length every step
    grew the process by GBs over a run."""
    length = max(int((b["segment_ids"] > 0).any(0).nonzero().max()) + 1 for b in raw)
    return bucketed(length, bucket, raw[0]["segment_ids"].shape[1])


def bucketed(length: int, bucket: int, limit: int) -> int:
    """`length` rounded up to a multiple of `bucket`, at most `limit`."""
    return min(-(-length // bucket) * bucket, limit)


def step_batches(raw: list, pack: bool, bucket: int = 1) -> list:
    """One step's micro-batches in the model's terms, cut to `step_length`. Every micro-batch
    of a step keeps one length, as pipeline schedules require."""
    length = step_length(raw, bucket)
    return [model_batch({k: v[:, :length] for k, v in b.items()}, pack) for b in raw]

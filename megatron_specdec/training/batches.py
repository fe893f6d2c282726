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

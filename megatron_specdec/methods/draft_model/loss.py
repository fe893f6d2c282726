"""A draft GPT's distillation loss: at every position whose next token is scored, its
next-token distribution against the base's (gathered over TP)."""

from megatron_specdec.models.layers import losses
from megatron_specdec.models.layers.vocab_parallel import vocab_parallel_gather


def loss(model, state, input_ids, loss_mask, attention_mask) -> dict:
    """The loss report of `model` (a SpeculativeGPTModel's last stage) from its base state."""
    b, s = input_ids.shape
    rows = losses.next_token_mask(loss_mask).reshape(-1).nonzero().squeeze(1)
    scored = rows.numel()
    rows = losses.bucket_rows(rows, model.scored_rows_bucket)
    _, base_logits = model.base_head(state.residual.reshape(s * b, 1, -1)[rows])
    base_logits = vocab_parallel_gather(base_logits, model.vocab_size)
    draft_logits = model.draft.logits(input_ids, attention_mask, rows)
    return losses.distill_loss(draft_logits[:scored], base_logits[:scored], model.vocab_size,
                               model.draft.group)

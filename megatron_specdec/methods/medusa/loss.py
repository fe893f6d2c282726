"""Medusa's training loss: head i predicts the token i + 2 ahead, weighted per head."""

from megatron.core import parallel_state as ps

from megatron_specdec.models.layers import losses


def loss(model, state, input_ids, loss_mask, attention_mask) -> dict:
    """The loss report of `model` (a SpeculativeGPTModel's last stage) from its base state."""
    hidden, base_logits = model.base_head(state.residual)
    vocab_offset = ps.get_tensor_model_parallel_rank() * base_logits.shape[-1]
    return losses.medusa_loss(model.draft(hidden), input_ids, loss_mask,
                              model.spec_config.medusa_head_weights, vocab_offset)

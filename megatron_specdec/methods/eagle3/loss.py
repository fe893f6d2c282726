"""EAGLE3's training loss over the speculative model's forward: the draft's training-time-test
chain of ttt_steps predictions per scored position against the base's next-token
distributions (models.layers.losses holds the vocab-parallel math)."""

import torch

from megatron.core import parallel_state as ps

from megatron_specdec.models.layers import losses


def loss(model, state, input_ids, loss_mask, attention_mask) -> dict:
    """The loss report of `model` (a SpeculativeGPTModel's last stage) from its base state."""
    cfg, draft = model.spec_config, model.draft
    b, s = input_ids.shape
    masks = losses.chain_masks(loss_mask, attention_mask, cfg.ttt_steps)
    rows = masks[0].nonzero().squeeze(1)  # positions u step 0 scores, s-major over [s, b]
    scored = rows.numel()
    rows = losses.bucket_rows(rows, model.scored_rows_bucket)
    row_masks = masks[:, rows]
    row_masks[:, scored:] = 0  # the bucket's padding scores nothing
    residual = state.residual.reshape(s * b, 1, -1)
    targets = []
    for chunk in rows.split(model.loss_chunk_rows):  # base logits at u+1, a chunk at a time
        _, base_logits = model.base_head(residual[chunk + b])
        base_offset = ps.get_tensor_model_parallel_rank() * base_logits.shape[-1]
        targets.append(losses.eagle3_targets(
            base_logits.reshape(chunk.numel(), -1), draft.target_ids(),
            cfg.padded_draft_vocab_size, base_offset, model.vocab_size))
    aux = torch.cat(state.aux, dim=-1)
    next_embeds = torch.cat([state.embeds[1:], state.embeds[-1:]])  # token u+1 at u
    step_hidden = draft.ttt_hidden(
        aux, next_embeds, model.rotary_pos_emb(s), attention_mask, cfg.ttt_steps, rows)
    return losses.eagle3_loss(
        step_hidden, draft.head, torch.cat([t for t, _ in targets]),
        torch.cat([top for _, top in targets]), row_masks, draft.target_ids(),
        draft.t2d, draft.vocab_offset, cfg.ttt_decay, model.loss_chunk_rows)

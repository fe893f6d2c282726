"""DFlash's training loss: blocks at random anchor positions, all in one draft forward.

Per sequence, `anchors_per_sequence` anchors a are drawn among the positions whose next
token is scored. Block a is [token a, mask x (B-1)] at positions a..a+B-1; it sees the
context before a and its own block (layers.block_attention_mask). Block position i is
scored against token a+i (cross-entropy over the base's vocabulary through the shared
output layer, vocab-parallel) with weight exp(-(i-1)/gamma). The scores are
[anchors*B, s + anchors*B] per head: memory linear in the sequence length.

The anchors are drawn from a generator seeded by the batch's token ids (crc32): every TP
rank and pipeline stage draws the same ones, and a resumed run draws what the uninterrupted
run drew.
"""

import zlib

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from megatron_specdec.models.layers.losses import _pack
from megatron_specdec.models.layers.vocab_parallel import vocab_parallel_argmax
from megatron_specdec.methods.dflash.layers import block_attention_mask
from megatron_specdec.methods.dflash.model import draft_logits


def sample_anchors(input_ids, loss_mask, block_size: int, count: int):
    """(anchors [b, count] long, valid [b, count] bool): positions a with token a+1 scored,
    without replacement; rows with fewer such positions repeat position 0, invalid."""
    b, s = input_ids.shape
    seed = zlib.crc32(input_ids.detach().cpu().to(torch.int64).numpy().tobytes())
    scores = torch.rand(b, s, generator=torch.Generator().manual_seed(seed))
    ok = torch.zeros(b, s, dtype=torch.bool)
    ok[:, :-1] = loss_mask[:, 1:].detach().cpu().bool()
    scores = scores.masked_fill(~ok, -1.0)
    top, anchors = scores.topk(min(count, s), dim=1)
    valid = top >= 0
    return anchors.masked_fill(~valid, 0), valid


def block_targets(input_ids, loss_mask, anchors, valid, block_size: int, base_mask=None):
    """(targets [b, n, B-1], scored [b, n, B-1]) : token a+i for block position i >= 1; with
    packed rows (base_mask [b|1, 1, s, s]) only the tokens of the anchor's own sequence."""
    b, s = input_ids.shape
    pos = anchors[..., None] + torch.arange(1, block_size)  # [b, n, B-1]
    inside = pos < s
    pos = pos.clamp(max=s - 1)
    flat = pos.reshape(b, -1)
    targets = input_ids.cpu().gather(1, flat).reshape(pos.shape)
    scored = loss_mask.cpu().bool().gather(1, flat).reshape(pos.shape) & inside & valid[..., None]
    if base_mask is not None:  # token a+i belongs to the anchor's sequence if it sees a
        sees = ~base_mask[:, 0].cpu().expand(b, s, s)
        scored &= sees[torch.arange(b)[:, None, None], pos, anchors[..., None]]
    return targets, scored


def dflash_loss(model, state, input_ids, loss_mask, attention_mask) -> dict:
    cfg, draft = model.spec_config, model.draft
    B, n = cfg.block_size, cfg.anchors_per_sequence
    b, s = input_ids.shape
    dev = state.residual.device
    anchors, valid = sample_anchors(input_ids, loss_mask, B, n)
    targets, scored = block_targets(input_ids, loss_mask, anchors, valid, B, attention_mask)
    anchors, targets, scored = anchors.to(dev), targets.to(dev), scored.to(dev)
    n = anchors.shape[1]

    context = draft.context(torch.cat(state.aux, dim=-1))  # [s, b, h]
    anchor_embeds = state.embeds.gather(0, anchors.t()[..., None].expand(n, b, state.embeds.shape[-1]))
    block = draft.block_inputs(anchor_embeds, B)  # [n*B, b, h]
    rotary = model.rotary_pos_emb(s + B)  # [s+B, 1, 1, d]
    positions = (anchors.t()[:, None] + torch.arange(B, device=dev)[None, :, None]).reshape(n * B, b)
    block_rotary = rotary[positions].reshape(n * B, b, 1, rotary.shape[-1])
    mask = block_attention_mask(anchors, B, s, attention_mask)
    hidden = draft(block, context, block_rotary, rotary[:s], mask)  # [n*B, b, h]

    # Block position 0 (the anchor) is not scored: its token is known.
    hidden = hidden.reshape(n, B, b, -1)[:, 1:].permute(2, 0, 1, 3).reshape(b * n * (B - 1), 1, -1)
    logits = draft_logits(model, hidden).float()  # [rows, 1, V/TP]
    tgt = targets.reshape(-1, 1)
    ce = vocab_parallel_cross_entropy(logits, tgt).reshape(b, n, B - 1)
    weights = torch.exp(-torch.arange(B - 1, device=dev, dtype=torch.float32) / cfg.loss_decay_gamma)
    w = scored.float() * weights
    total = (ce * w).sum()
    offset = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    hit = (vocab_parallel_argmax(logits[:, 0].detach(), offset).reshape(b, n, B - 1) == targets) & scored
    per_pos = (ce.detach() * scored).sum((0, 1))
    count = scored.sum((0, 1)).float()
    return _pack(total, scored[..., 0].sum().float(), {
        "step_loss": list(per_pos), "step_correct": list(hit.sum((0, 1)).float()),
        "step_count": list(count)})

"""Vocab-parallel draft losses: no rank ever materialises a full-vocabulary [tokens, V] tensor.

EAGLE3's target is the base distribution restricted to the draft vocabulary. Each TP rank
holds base logits for a slice of the target vocabulary and draft logits for a slice of the
draft vocabulary; the draft ids whose targets a rank holds form one contiguous range
(draft ids are sorted by target id), so a single all-to-all moves every target column to
the rank that holds the matching draft column. Softmax normalisers and the per-token sums
are then combined with all-reduces, and the backward pass is the local `q - p`.

EAGLE3's loss also never holds the logits of more than LOSS_CHUNK_ROWS scored positions:
base and draft logits are formed that many positions at a time, and when a micro-batch
scores more, each draft chunk's head and cross-entropy are recomputed in the backward pass,
so a step keeps only the scored hidden states, the fp32 targets and a chunk of logits.
"""

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch.utils.checkpoint import checkpoint

from megatron_specdec.models.layers.vocab_parallel import vocab_parallel_argmax

# Scored positions whose logits exist at once: [rows, V/TP] base and [rows, D/TP] fp32 draft
# logits (at an 8B shape 0.25 and 0.13 GB), where all of them would grow with the sequence.
LOSS_CHUNK_ROWS = 1024


def _tp(group=None):
    """(group, size, rank) of the vocabulary split: the TP group unless given (a replicated
    draft GPT passes its group of one)."""
    group = group or ps.get_tensor_model_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(t: Tensor, op=dist.ReduceOp.SUM, group=None) -> Tensor:
    group, size, _ = _tp(group)
    if size > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


@torch.no_grad()
def draft_target_logits(base_logits: Tensor, target_ids: Tensor, padded_draft_vocab: int) -> Tensor:
    """Base logits [N, Vp/TP] (this rank's target slice) -> logits of the draft vocabulary's
    targets in the draft lm_head layout [N, Dp/TP] (padded draft ids = -inf)."""
    group, size, rank = _tp()
    n, v_local = base_logits.shape
    d_local = padded_draft_vocab // size
    bounds = torch.searchsorted(target_ids, torch.arange(size + 1, device=target_ids.device) * v_local)
    mine = slice(int(bounds[rank]), int(bounds[rank + 1]))  # draft ids whose targets I hold
    columns = base_logits[:, target_ids[mine] - rank * v_local].t().contiguous()  # [n_mine, N]
    out = base_logits.new_full((d_local, n), float("-inf"))
    if size == 1:
        out[: columns.shape[0]] = columns
        return out.t()
    d_starts = [r * d_local for r in range(size + 1)]

    def overlap(a0, a1, b0, b1):
        return max(0, min(a1, b1) - max(a0, b0))

    send = [overlap(mine.start, mine.stop, d_starts[r], d_starts[r + 1]) for r in range(size)]
    recv = [overlap(int(bounds[q]), int(bounds[q + 1]), d_starts[rank], d_starts[rank + 1])
            for q in range(size)]
    received = columns.new_empty(sum(recv), n)
    dist.all_to_all_single(received, columns, output_split_sizes=recv, input_split_sizes=send,
                           group=group)
    out[: received.shape[0]] = received  # sources arrive in draft-id order
    return out.t()


def _split_softmax(logits: Tensor, group=None):
    """exp(x - max), max and sum of the softmax of logits split over TP (float32)."""
    logits = logits.float()
    top = _all_reduce(logits.max(-1).values, dist.ReduceOp.MAX, group)
    exp = torch.exp(logits - top[:, None])
    return exp, top, _all_reduce(exp.sum(-1), group=group)


@torch.no_grad()
def target_probs(target_logits: Tensor, group=None) -> Tensor:
    """Softmax of vocab-parallel target logits; computed once and shared by every TTT step."""
    exp, _, total = _split_softmax(target_logits, group)
    return exp.div_(total[:, None])


class _SoftCrossEntropy(torch.autograd.Function):
    """-sum_d p_d log q_d per token, both distributions split over TP on the same columns.

    Since p sums to one, this is logsumexp(x) - sum_d p_d x_d: no [N, D] log q is formed, and
    only the first `valid` local columns enter the dot product (the rest are padding, -inf
    logits with p = 0)."""

    @staticmethod
    def forward(ctx, logits: Tensor, p: Tensor, valid: int, group):
        x = logits.float()
        q_exp, q_max, q_sum = _split_softmax(x, group)
        dot = _all_reduce((p[:, :valid] * x[:, :valid]).sum(-1), group=group)
        ctx.save_for_backward(q_exp.div_(q_sum[:, None]), p)
        return q_max + torch.log(q_sum) - dot

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, p = ctx.saved_tensors
        return (q - p) * grad[:, None], None, None, None


def soft_cross_entropy(logits: Tensor, probs: Tensor, valid: Optional[int] = None,
                       group=None) -> Tensor:
    """Per-token soft cross-entropy [N] of vocab-parallel logits against vocab-parallel target
    probabilities `probs` (from `target_probs`; softmax over the whole, split, vocabulary);
    `valid`: this rank's columns before its padding (default all); `group`: see `_tp`."""
    return _SoftCrossEntropy.apply(logits, probs, logits.shape[-1] if valid is None else valid,
                                   group)


def _shift_mask(loss_mask: Tensor, shift: int) -> Tensor:
    """Token-aligned mask [b, s] -> [s, b] mask of position t scoring token t+shift."""
    b, s = loss_mask.shape
    out = torch.zeros(s, b, dtype=torch.float32, device=loss_mask.device)
    if shift < s:
        out[: s - shift] = loss_mask[:, shift:].t().float()
    return out


def bucket_rows(rows: Tensor, bucket: int) -> Tensor:
    """Scored positions padded to a multiple of `bucket` by repeating the first. In bf16,
    oneDNN keeps a kernel per GEMM shape, so a scored-row count new at each step grows memory
    for hundreds of steps (bench/bench_soak.py); the caller masks the padded rows out."""
    pad = -rows.numel() % bucket
    return torch.cat([rows, rows[:1].expand(pad)]) if pad and rows.numel() else rows


def next_token_mask(loss_mask: Tensor) -> Tensor:
    """[s, b] mask of the positions whose next token is scored."""
    return _shift_mask(loss_mask, 1)


def _chain_mask(loss_mask: Tensor, attention_mask: Optional[Tensor], step: int) -> Tensor:
    """[s, b] mask of step `step`: position u is scored on token u+2 if its chain's real
    prefix (ending at u-step) exists and, with packed sequences, lies in u's sequence."""
    mask = _shift_mask(loss_mask, 2)
    mask[:step] = 0
    if attention_mask is not None and step:
        s = mask.shape[0]
        u = torch.arange(step, s, device=mask.device)
        sees_start = ~attention_mask[:, 0, u, u - step]  # [b|1, s-step]
        mask[step:] *= sees_start.t().float()
    return mask


def chain_masks(loss_mask: Tensor, attention_mask: Optional[Tensor], steps: int) -> Tensor:
    """[steps, s*b] masks (s-major, as [s, b] flattened) of the positions each TTT step
    scores; every step's positions are among step 0's."""
    return torch.stack([_chain_mask(loss_mask, attention_mask, k).reshape(-1)
                        for k in range(steps)])


@torch.no_grad()
def eagle3_targets(base_logits: Tensor, target_ids: Tensor, padded_draft_vocab: int,
                   base_offset: int, vocab_size: int) -> Tuple[Tensor, Tensor]:
    """This rank's base logits [n, Vp/TP] of n scored positions -> (the target distribution
    over the draft vocabulary, this rank's columns [n, Dp/TP] fp32; the base's top-1 target
    id [n]). Called on chunks of positions: neither output keeps a full-vocabulary column."""
    target = target_probs(draft_target_logits(base_logits, target_ids, padded_draft_vocab))
    padded = torch.arange(base_offset, base_offset + base_logits.shape[1],
                          device=base_logits.device) >= vocab_size
    if padded.any():
        base_logits = base_logits.masked_fill(padded, float("-inf"))
    return target, vocab_parallel_argmax(base_logits, base_offset)


def _head_cross_entropy(head: Callable, hidden: Tensor, target: Tensor, valid: int,
                        draft_offset: int):
    """(soft cross-entropy [n], draft top-1 draft id [n]) of hidden states [n, 1, h]."""
    logits = head(hidden).reshape(hidden.shape[0], -1)
    ce = soft_cross_entropy(logits, target, valid)
    with torch.no_grad():
        return ce, vocab_parallel_argmax(logits, draft_offset)


def eagle3_loss(step_hidden: List[Tensor], head: Callable, target: Tensor, base_top: Tensor,
                masks: Tensor, target_ids: Tensor, t2d: Tensor, draft_offset: int,
                decay: float, chunk_rows: int = LOSS_CHUNK_ROWS) -> dict:
    """Training-time-test loss over the n positions step 0 scores. step_hidden[k]: the
    draft's last hidden states [n, 1, h] at those positions, `head` maps them to this rank's
    draft logits [n, 1, Dp/TP]; target, base_top: `eagle3_targets` of the base one position
    later (the draft output at u scores token u+2 against the base at u+1); masks: [steps, n]
    (`chain_masks` at those positions). Past `chunk_rows` positions the head and
    cross-entropy run `chunk_rows` at a time and are recomputed in backward (only [n, h]
    states are kept); up to it they run once and keep their logits, which is faster.

    As upstream EAGLE-3: a position whose base top-1 token is outside the draft vocabulary
    adds no loss (the draft cannot emit that token) but counts in the accuracy's
    denominator; the loss is normalised by every position step 0 scores.
    """
    in_vocab = t2d[base_top].float()
    valid = max(0, min(target.shape[1], target_ids.numel() - draft_offset))
    total = 0.0
    stats = {"step_loss": [], "step_correct": [], "step_count": []}
    for k, hidden in enumerate(step_hidden):
        pieces = list(zip(hidden.split(chunk_rows), target.split(chunk_rows)))
        if len(pieces) == 1:  # small enough to keep: no recompute, no extra head product
            chunks = [_head_cross_entropy(head, *pieces[0], valid, draft_offset)]
        else:
            chunks = [checkpoint(_head_cross_entropy, head, h, p, valid, draft_offset,
                                 use_reentrant=False) for h, p in pieces]
        ce = torch.cat([c for c, _ in chunks])
        draft_top = torch.cat([t for _, t in chunks])
        step_sum = (ce * (masks[k] * in_vocab)).sum()
        total = total + decay ** k * step_sum
        with torch.no_grad():
            hit = (target_ids[draft_top] == base_top).float()
        stats["step_loss"].append(step_sum.detach())
        stats["step_correct"].append((hit * masks[k]).sum())
        stats["step_count"].append(masks[k].sum())
    return _pack(total, masks[0].sum(), stats)


def medusa_loss(head_logits: List[Tensor], input_ids: Tensor, loss_mask: Tensor,
                weights: List[float], vocab_offset: int) -> dict:
    """Head i at position t predicts token t+2+i (hard cross-entropy, vocab-parallel)."""
    s, b, _ = head_logits[0].shape
    total = 0.0
    stats = {"step_loss": [], "step_correct": [], "step_count": []}
    for i, (logits, weight) in enumerate(zip(head_logits, weights)):
        shift = 2 + i
        labels = torch.zeros(s, b, dtype=torch.long, device=input_ids.device)
        if shift < s:
            labels[: s - shift] = input_ids[:, shift:].t()
        mask = _shift_mask(loss_mask, shift)
        ce = vocab_parallel_cross_entropy(logits.float(), labels)
        head_sum = (ce * mask).sum()
        total = total + weight * head_sum
        with torch.no_grad():
            top = vocab_parallel_argmax(logits.reshape(s * b, -1), vocab_offset).view(s, b)
        stats["step_loss"].append(head_sum.detach())
        stats["step_correct"].append(((top == labels).float() * mask).sum())
        stats["step_count"].append(mask.sum())
    return _pack(total, _shift_mask(loss_mask, 2).sum(), stats)


def distill_loss(draft_logits: Tensor, base_logits: Tensor, vocab_size: int, group) -> dict:
    """Forward KL of a draft GPT to the base, as the cross-entropy of the draft's next-token
    distribution against the base's (the base entropy is a constant), over n scored positions.
    draft_logits, base_logits: [n, Vp], whole vocabularies (the draft is replicated, the base
    logits gathered); padded ids past `vocab_size` take no part. Reports top-1 agreement."""
    draft_logits = draft_logits[:, :vocab_size]
    p = target_probs(base_logits[:, :vocab_size], group)
    ce = soft_cross_entropy(draft_logits, p, group=group)
    with torch.no_grad():
        hit = (draft_logits.argmax(-1) == p.argmax(-1)).float()
    total = ce.sum()
    n = torch.tensor(float(ce.shape[0]), device=ce.device)
    return _pack(total, n, {"step_loss": [total.detach()], "step_correct": [hit.sum()],
                            "step_count": [n]})


def _pack(total, num_tokens, stats) -> dict:
    out = {"loss_sum": total, "num_tokens": num_tokens}
    out.update({k: torch.stack(v) for k, v in stats.items()})
    return out


def loss_func(output: dict):
    """Megatron schedule loss function: (loss_sum, num_tokens, report). The schedule divides
    by num_tokens (tokens scored at step 0 / head 0) and the number of micro-batches."""
    # Copies: the schedule scales the returned loss in place.
    report = {k: v.detach().clone() for k, v in output.items()}
    return output["loss_sum"], output["num_tokens"].int(), report


def accuracies(report: dict) -> List[float]:
    """Top-1 accuracy of each step / head from a loss report."""
    count = report["step_count"].clamp(min=1)
    return (report["step_correct"] / count).tolist()

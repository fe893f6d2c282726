"""Training-time-test attention in memory linear in the sequence length.

At unrolled step k the query at position u continues the chain that started from the real
prefix ending at u-k: it sees the step-0 keys the base mask allows for row u-k, and for each
earlier step j >= 1 exactly one key, the same chain's at position u-k+j. A dense mask over
all (k+1)*s keys costs (k+1)*s^2 scores per head, nearly all masked.

Here one `scaled_dot_product_attention` call (flash / memory-efficient kernels, on CPU too)
evaluates the whole step. The k chain keys become k "sink" keys placed in front of the
step-0 keys, which are shifted right by k; queries and keys gain k coordinates so that
sink p scores, for query u, the per-position dot product with its chain key (u's extra
coordinate p holds that dot product, sink p is the unit vector e_p there, the step-0 keys
are 0 there), and the values gain k coordinates so that sink p returns its softmax weight
(e_p). Under a plain causal mask query u then sees exactly sinks 0..min(u, k-1) (the chain
keys that exist: sink p is step j = k-p, at position u-p) and step-0 keys 0..u-k: the
causal prefix of row u-k. One softmax spans prefix and chain keys, so this is the dense
mask's attention exactly (the log-sum-exp merge upstream EAGLE-3 trainers do by hand,
here inside the kernel and differentiated by it), and no s x s scores are ever stored:
the kernels keep one tile of them and the log-sum-exp per row. The chain values are then
added with the returned weights as per-position products.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class TTTMask:
    """Attention of training-time-test step `step` over the step-0 keys (masked as the
    base mask's row u-step) and one key per later step. base_mask: [b|1, 1, s, s] bool,
    True = may not attend, or None for causal."""

    base_mask: Optional[Tensor]
    step: int

    def sdpa_mask(self, s: int) -> Optional[Tensor]:
        """The boolean attn_mask (True = attend) over [k sinks, step-0 keys shifted by k], or
        None when plain causal attention is that mask (no base mask)."""
        if self.base_mask is None:
            return None
        k = self.step
        allowed = F.pad(~self.base_mask[..., : s - k, : s - k], (k, 0, k, 0))
        allowed[..., :k] = torch.ones(s, k, dtype=torch.bool, device=allowed.device).tril()
        return allowed


def _shift_down(t: Tensor, n: int) -> Tensor:
    """Position u takes position u-n's value ([s, ...]; the first n rows are zeros)."""
    if n == 0:
        return t
    return torch.cat([t.new_zeros(n, *t.shape[1:]), t[:-n]])


def ttt_attention(query: Tensor, blocks: List[Tuple[Tensor, Tensor]], mask: TTTMask,
                  scale: float, dropout_p: float = 0.0) -> Tensor:
    """query [s, b, heads, d]; blocks[j] = (key, value) [s, b, groups, d] of step j (block
    `mask.step` is this step's); `dropout_p` drops attention probabilities. Returns the
    context [s, b, heads*d]. Rows u < step have no prefix; they still see their own key, so
    nothing is NaN (they are never scored)."""
    s, b, heads, d = query.shape
    k = mask.step
    groups = blocks[0][0].shape[2]
    rep = heads // groups
    # sink p is step j = k - p: its key/value at position u is that step's at u - p
    chain = [(_shift_down(blocks[k - p][0], p), _shift_down(blocks[k - p][1], p))
             for p in range(k)]
    grouped = query.reshape(s, b, groups, rep, d)
    dots = [(grouped * key[:, :, :, None]).sum(-1).view(s, b, heads) for key, _ in chain]
    q = torch.cat([query, torch.stack(dots, -1)], -1) if k else query

    def with_sinks(t: Tensor) -> Tensor:  # [s, b, groups, d] -> [b, groups, s, d+k]
        sinks = F.pad(torch.eye(k, dtype=t.dtype, device=t.device), (d, 0))  # e_p after d zeros
        body = F.pad(t[: s - k], (0, k))
        return torch.cat([sinks[:, None, None].expand(k, b, groups, d + k), body])

    keys, values = (with_sinks(t).permute(1, 2, 0, 3) for t in blocks[0])
    out = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), keys, values, attn_mask=mask.sdpa_mask(s),
        dropout_p=dropout_p, is_causal=mask.base_mask is None, scale=scale, enable_gqa=True,
    ).permute(2, 0, 1, 3)  # [s, b, heads, d+k]
    context = out[..., :d]
    for p, (_, value) in enumerate(chain):
        weight = out[..., d + p].reshape(s, b, groups, rep, 1)
        context = context + (weight * value[:, :, :, None]).reshape(s, b, heads, d)
    return context.reshape(s, b, heads * d)

"""Training-time-test attention evaluated through its structure, not a dense mask.

At unrolled step k the query at position u continues the chain that started from the real
prefix ending at u-k: it sees the step-0 keys the base mask allows for row u-k, and for each
earlier step j >= 1 exactly one key, the same chain's at position u-k+j. A dense mask over
all (k+1)*s keys costs (k+1)*s^2 scores per head (28*s^2 over seven steps, nearly all
masked); here step k costs one s x s block plus k scores per query (7*s^2 + 28*s), and the
softmax runs over the concatenated scores, so the result is the dense mask's exactly.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class TTTMask:
    """Attention of training-time-test step `step` over the step-0 keys (masked as the
    base mask's row u-step) and one key per later step. base_mask: [b|1, 1, s, s] bool,
    True = may not attend, or None for causal."""

    base_mask: Optional[Tensor]
    step: int

    def prefix_mask(self, s: int, device) -> Tensor:
        """[b|1, 1, s, s] mask of the step-0 keys: row u is the base mask's row u-step."""
        base = self.base_mask
        if base is None:
            base = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)[None, None]
        rows = torch.arange(s, device=base.device) - self.step
        return base[..., rows.clamp(min=0), :] | (rows < 0)[:, None]


def _shift_down(t: Tensor, n: int) -> Tensor:
    """Position u takes position u-n's value ([s, ...]; the first n rows are zeros)."""
    if n == 0:
        return t
    return torch.cat([t.new_zeros(n, *t.shape[1:]), t[:-n]])


def ttt_attention(query: Tensor, blocks: List[Tuple[Tensor, Tensor]], mask: TTTMask,
                  scale: float, dropout=None) -> Tensor:
    """query [s, b, heads, d]; blocks[j] = (key, value) [s, b, groups, d] of step j (block
    `mask.step` is this step's); `dropout` applies to the probabilities. Returns the context [s, b, heads*d]. Rows u < step have no
    prefix; they still see their own key, so nothing is NaN (they are never scored)."""
    s, b, heads, d = query.shape
    k = mask.step
    rep = heads // blocks[0][0].shape[2]

    def per_head(t):  # [s, b, groups, d] -> [s, b, heads, d]
        return t if rep == 1 else t.repeat_interleave(rep, dim=2)

    q = query.permute(1, 2, 0, 3)  # [b, heads, s, d]
    key0 = per_head(blocks[0][0]).permute(1, 2, 3, 0)  # [b, heads, d, s]
    prefix = torch.matmul(q, key0).float() * scale
    prefix = prefix.masked_fill(mask.prefix_mask(s, query.device), float("-inf"))
    chain_keys = [per_head(_shift_down(blocks[j][0], k - j)) for j in range(1, k + 1)]
    chain_values = [per_head(_shift_down(blocks[j][1], k - j)) for j in range(1, k + 1)]
    if chain_keys:
        chain = torch.stack([(query * key).sum(-1) for key in chain_keys], -1)  # [s, b, h, k]
        u = torch.arange(s, device=query.device)[:, None]
        missing = u < torch.arange(k - 1, -1, -1, device=query.device)  # [s, k]: u-k+j < 0
        chain = chain.permute(1, 2, 0, 3).float().masked_fill(missing, float("-inf"))
        scores = torch.cat([prefix, chain * scale], -1)
    else:
        scores = prefix
    probs = torch.softmax(scores, -1).to(query.dtype)
    if dropout is not None:
        probs = dropout(probs)
    value0 = per_head(blocks[0][1]).permute(1, 2, 0, 3)  # [b, heads, s, d]
    context = torch.matmul(probs[..., :s], value0).permute(2, 0, 1, 3)  # [s, b, heads, d]
    for j, value in enumerate(chain_values):
        weight = probs[..., s + j].permute(2, 0, 1)[..., None]  # [s, b, heads, 1]
        context = context + weight * value
    return context.reshape(s, b, heads * d)

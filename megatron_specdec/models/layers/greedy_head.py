"""Greedy decoding's output layer: each position's argmax token without most of its float32
logits (csrc/greedy_head.h).

A greedy step reads only the argmax of the output layer, whose float32 weight is a fifth of a
small model's bytes (SmolLM2-135M: 113 of 538 MB). An int8 copy (a scale per row) screens all
rows at a quarter of the bytes; the rows that can still hold the maximum are computed again in
float32 by the skinny GEMM's own per-element arithmetic. The result is the token the float32
logits and torch.argmax give, bitwise, at any row count: rows 1..16 take the skinny op in the
logits path too (linear_kernels), and a row's logit does not depend on the rows beside it.

The screen: row n of the weight is w^_n = s_n q_n (q_n int8), a row of x is x^ = t p (p int16,
|p| <= 32767 and K 127 |p| within int32), and D_n = q_n . p is summed in int32 exactly, by
every ISA path alike. The screened logit is z_n = fl(fl(s_n t) fl(D_n)), within 3.0001 u of
w^_n . x^ (u = 2^-24).

Why the screen cannot drop the maximum: the float32 logit y_n is within gamma ||w_n|| ||x|| of
w_n . x (K products summed in lanes, then a fixed sum of the lanes; gamma = m u / (1 - m u),
m = K + 8), and w_n . x - w^_n . x^ = (w_n - w^_n) . x + w^_n . (x - x^). With X >= ||x||,
E >= ||x - x^|| and ||x^|| <= X + E, |y_n - z_n| + u |z_n| <= a'_n X + c'_n E for
a'_n = ||w_n - w^_n|| + gamma ||w_n|| + 4.0002 u ||w^_n|| and c'_n = ||w^_n|| (1 + 4.0002 u).
The bound kept, bound[0] = a_n and bound[1] = c_n, uses 5.0001 u for 4.0002 u and is widened by
2^-10 in float64 before rounding up to float32, so the op's float32 a_n X + c_n E and
z_n +- it (three roundings, each within u of its value) still cover |y_n - z_n|; a constant
2^-100 covers what underflow takes from those relative bounds. The maximum y_a then satisfies
hi_a >= y_a >= y_j >= lo_j for every j, so it is kept.
"""

import math
import weakref
from functools import lru_cache
from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron_specdec.acceptance.ops import op_available
from megatron_specdec.models import first_use
from megatron_specdec.models.layers.linear_kernels import INVARIANT_ROWS, product, skinny_schedule
from megatron_specdec.models.layers.vocab_parallel import best_of_gathered, gather_over_ranks
from megatron_specdec.models.weight_memory import huge_page_empty


class GreedyHead:
    """The int8 screening copy of rows [0, rows) of a float32 output weight [N, K] (this TP
    rank's vocabulary slice, its padding rows left out), its row scales and its bounds."""

    def __init__(self, weight: Tensor, rows: int):
        k = weight.shape[1]
        self.weight = weight[:rows]
        self.screen = huge_page_empty(rows * k, torch.int8).view(rows, k)
        self.scale = torch.empty(rows)
        u = 2.0 ** -24
        gamma = (k + 8) * u / (1 - (k + 8) * u)
        bound = torch.empty(2, rows, dtype=torch.float64)
        for start in range(0, rows, 4096):  # float64 copies of a few MB at a time
            end = min(rows, start + 4096)
            w = self.weight[start:end]
            scale = w.abs().amax(dim=1) / 127
            usable = torch.isfinite(scale) & (scale > 0)
            q = torch.where(usable[:, None], w / scale[:, None], 0).round_().clamp_(-127, 127)
            q = q.nan_to_num_(0.0)
            scale = torch.where(usable, scale, 0)
            self.screen[start:end] = q.to(torch.int8)
            self.scale[start:end] = scale
            w, wq = w.double(), q.double() * scale.double()[:, None]  # s q: exact in float64
            norm_q = wq.norm(dim=1)
            bound[0, start:end] = ((w - wq).norm(dim=1) + gamma * w.norm(dim=1)
                                   + 5.0001 * u * norm_q)
            bound[1, start:end] = norm_q * (1 + 5.0001 * u)
            # A row with a value that is not finite is always computed in float32.
            bound[0, start:end][~torch.isfinite(w).all(dim=1)] = math.inf
        bound = (bound * (1 + 2.0 ** -10)).float()
        self.bound = torch.nextafter(bound, torch.full_like(bound, math.inf))

    def __call__(self, x: Tensor, screened: bool = False) -> Tuple[Tensor, ...]:
        """(ids [m], float32 logits at them [m]) of x [m, K], and with `screened` every
        screened logit [m, rows] (each within its bound of the float32 one); a slice of
        padding rows only (a TP rank past the vocabulary) offers id 0 at -inf."""
        if not self.weight.shape[0]:
            m = x.shape[0]
            return (torch.zeros(m, dtype=torch.long), torch.full((m,), -math.inf),
                    torch.empty(m, 0))[:3 if screened else 2]
        out = torch.ops.megatron_specdec.greedy_head(x, self.screen, self.scale, self.weight,
                                                       self.bound, screened)
        return out if screened else out[:2]


# K 127 127 within int32: the screen's x keeps at least int8's resolution (csrc/greedy_head.cpp).
MAX_IN_FEATURES = (2 ** 31 - 1) // (127 * 127)

# id -> (weak reference, key, head) of each output weight's screening copy, built at its
# first greedy step and kept while the weight lives, unless its storage or values change
# (placement on huge pages, training); keyed by id, as tensors compare elementwise.
_heads = {}


@lru_cache(maxsize=None)
def _vector_op() -> bool:
    """Whether the op is built and the skinny GEMM takes a vector path (fixed for the
    process: asked once, not every step)."""
    return (op_available("greedy_head")
            and torch.ops.megatron_specdec.skinny_linear_isa() != "scalar")


def greedy_head(weight: Tensor, rows: int, tokens: int) -> Optional[GreedyHead]:
    """The screened head of rows [0, rows) of `weight` for a forward of `tokens` rows of x,
    or None where the logits path must run: a weight that is not float32 on the CPU, more rows
    than the row-invariant products take, a product other than the skinny op in force for
    them (a pinned product, no extension), a CPU without a vector path (the scalar screen is
    slower than the float32 product it saves), or more in-features than the screen's int32
    sums hold. The answer is the same on every TP rank."""
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.stride(1) != 1
            or not 1 <= tokens <= INVARIANT_ROWS or weight.shape[1] > MAX_IN_FEATURES
            or not _vector_op()
            or skinny_schedule(product(weight, tokens)) is None):
        return None
    key = (weight.data_ptr(), weight._version, rows)
    found = _heads.get(id(weight))
    if found is None or found[0]() is not weight or found[1] != key:
        number = id(weight)
        found = _heads[number] = (weakref.ref(weight, lambda _: _heads.pop(number, None)), key,
                                  GreedyHead(weight, rows))
        first_use.note()
    return found[2]


def output_argmax(x: Tensor, weight: Tensor, vocab_size: int, group):
    """Argmax ids [n] over the whole vocabulary of x [n, h] times this TP rank's slice of a
    float32 output weight (its padding rows past `vocab_size` left out), bitwise those of the
    gathered float32 logits (ties: the lowest id), through the screened head; None where the
    head does not run (greedy_head: the caller's logits path must)."""
    found = _screened(x, weight, vocab_size, group, False)
    return None if found is None else found[0]


def output_argmax_confidence(x: Tensor, weight: Tensor, vocab_size: int, group):
    """(output_argmax's ids [n], their softmax probability [n] float64) or None. The
    probability is the float32 maximum over the log-sum-exp of the screened logits: each
    screened logit is within its row's bound of the float32 one, so their log-sum-exp, and
    with it the log-probability, is within the largest bound of the logits path's (a
    confidence policy's input, not a draft)."""
    found = _screened(x, weight, vocab_size, group, True)
    if found is None:
        return None
    ids, values, lse = found
    return ids, (values.double() - lse.double()).exp()


def _screened(x, weight, vocab_size, group, confidence: bool):
    """(ids, largest float32 logits, and with `confidence` the screened log-sum-exp) over
    every TP rank's slice, or None where the head does not run."""
    offset = group.rank() * weight.shape[0]
    rows = max(0, min(weight.shape[0], vocab_size - offset))
    head = greedy_head(weight, rows, x.shape[0]) if x.dtype == torch.float32 else None
    if head is None:
        return None
    if not confidence:
        ids, values = head(x)
        lse = None
    else:
        ids, values, screened = head(x, screened=True)
        lse = screened.logsumexp(-1)
    if group.size() == 1:
        return ids, values, lse
    # One gather for the ids, their logits and the log-sum-exps: [TP, 2 or 3, n].
    stacked = gather_over_ranks([values, ids + offset] + ([] if lse is None else [lse]), group)
    best = best_of_gathered(stacked)
    if lse is None:
        return best, None, None
    return best, stacked[:, 0].amax(0), stacked[:, 2].logsumexp(0)

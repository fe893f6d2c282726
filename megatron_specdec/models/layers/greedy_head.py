"""Greedy decoding's output layer: each position's argmax token without most of its float32
logits (csrc/greedy_head.h).

A greedy step reads only the argmax of the output layer, whose float32 weight is a fifth of a
small model's bytes (SmolLM2-135M: 113 of 538 MB). A float16 copy screens all rows at half the
bytes; the rows that can still hold the maximum are computed again in float32 by the skinny
GEMM's own per-element arithmetic. The result is the token the float32 logits and
torch.argmax give, bitwise, at any row count: rows 1..16 take the skinny op in the logits
path too (linear_kernels), and a row's logit does not depend on the rows beside it.

Why the screen cannot drop the maximum: for output row n and input x, the float32 logit y_n
and the screened one z_n each differ from their exact dot products by at most
gamma * sum |w||x| (K products summed in lanes, then a fixed sum of the lanes; gamma =
m u / (1 - m u) with m = K + 8 covering both, u = 2^-24), and the exact ones by
|(w - w16) . x| <= ||w - w16|| ||x||. So |y_n - z_n| <= bound_n ||x|| with
bound_n = ||w_n - w16_n|| + gamma (||w_n|| + ||w16_n||), computed here in float64 and widened
by 8/K for the op's own float32 interval arithmetic (each rounding is at most u |z_n|, and
|z_n| <= ||w16_n|| ||x|| (1 + gamma) is below bound_n ||x|| / gamma). The maximum y_a then
satisfies z_a + bound_a ||x|| >= y_a >= y_j >= z_j - bound_j ||x|| for every j, so it is kept.
"""

import math
import weakref
from functools import lru_cache
from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron_specdec.acceptance.ops import op_available
from megatron_specdec.models.layers.linear_kernels import INVARIANT_ROWS, product, skinny_block
from megatron_specdec.models.weight_memory import huge_page_empty

class GreedyHead:
    """The screening copy of rows [0, rows) of a float32 output weight [N, K] (this TP rank's
    vocabulary slice, its padding rows left out) and each row's bound."""

    def __init__(self, weight: Tensor, rows: int):
        k = weight.shape[1]
        self.weight = weight[:rows]
        self.screen = huge_page_empty(rows * k, torch.float16).view(rows, k)
        self.screen.copy_(self.weight)
        u = 2.0 ** -24
        gamma = (k + 8) * u / (1 - (k + 8) * u)
        bound = torch.empty(rows, dtype=torch.float64)
        for start in range(0, rows, 4096):  # float64 copies of a few MB at a time
            w = self.weight[start:start + 4096].double()
            w16 = self.screen[start:start + 4096].double()
            bound[start:start + 4096] = ((w - w16).norm(dim=1)
                                         + gamma * (w.norm(dim=1) + w16.norm(dim=1)))
        bound = (bound * (1 + 8 / k) + 1e-30).float()
        self.bound = torch.nextafter(bound, torch.full_like(bound, math.inf))

    def __call__(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """(ids [m], float32 logits at them [m]) of x [m, K]; a slice of padding rows only
        (a TP rank past the vocabulary) offers id 0 at -inf."""
        if not self.weight.shape[0]:
            return (torch.zeros(x.shape[0], dtype=torch.long),
                    torch.full((x.shape[0],), -math.inf))
        return torch.ops.megatron_specdec.greedy_head(x, self.screen, self.weight, self.bound)


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
    them (a pinned product, no extension), or a CPU without a vector path (the scalar
    widening of float16 is slower than the float32 product it saves). The answer is the same on every TP rank. (A weight
    beyond float16's range screens to infinities, and the op computes such rows in float32.)"""
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.stride(1) != 1
            or not 1 <= tokens <= INVARIANT_ROWS or not _vector_op()
            or skinny_block(product(weight, tokens)) is None):
        return None
    key = (weight.data_ptr(), weight._version, rows)
    found = _heads.get(id(weight))
    if found is None or found[0]() is not weight or found[1] != key:
        number = id(weight)
        found = _heads[number] = (weakref.ref(weight, lambda _: _heads.pop(number, None)), key,
                                  GreedyHead(weight, rows))
    return found[2]

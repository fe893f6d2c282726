"""Column/RowParallelLinear whose no-grad forward over a few rows puts the weight on the left.

Decoding multiplies 1-16 rows by each weight. CPU GEMM libraries handle `x @ W.T` with so few
rows far below memory bandwidth (a single row takes a slow matrix-vector path), while the
same product as `W @ x.T` with at least two rows streams the weight near bandwidth
(bench/bench_linear.py measures both orders). Training, and any forward that tracks
gradients or has many rows, takes megatron's own path unchanged.
"""

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

# Up to here: 2-4x faster at 1-4 rows, 0.8-1.3x at 8-128 (bench/bench_linear.py); one cut-over
# far above a verify forward's rows keeps verify and plain steps on the same kernels.
MAX_ROWS = 128


def small_rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T for a handful of rows, as `weight @ x.T`; one row is
    doubled, since the two-row product is the fast one (and an expanded, stride-0 operand
    takes a slow path: it is copied)."""
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    if single:
        rows = rows.expand(2, -1).contiguous()
    out = torch.mm(weight, rows.t()).t()
    # Contiguous: a tensor-parallel all-reduce works in place on the result.
    return (out[:1] if single else out).contiguous().view(*x.shape[:-1], weight.shape[0])


def uses_small_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (not torch.is_grad_enabled() or not weight.requires_grad) \
        and x.numel() <= MAX_ROWS * x.shape[-1] and x.device.type == "cpu"


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T by whichever product suits the row count (no bias)."""
    if uses_small_rows(x, weight):
        return small_rows_linear(x, weight)
    return torch.nn.functional.linear(x, weight)


class _SmallRowsMixin:
    def _forward_impl(self, input, weight, bias=None, *args, **kwargs):
        if uses_small_rows(input, weight) and not kwargs.get("sequence_parallel", False):
            out = small_rows_linear(input, weight)
            return out if bias is None else out + bias
        return super()._forward_impl(input, weight, bias, *args, **kwargs)


class SmallRowsColumnParallelLinear(_SmallRowsMixin, ColumnParallelLinear):
    pass


class SmallRowsRowParallelLinear(_SmallRowsMixin, RowParallelLinear):
    pass

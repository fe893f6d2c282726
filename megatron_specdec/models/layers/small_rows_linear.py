"""Column/RowParallelLinear whose no-grad forward over a few rows takes the product measured
fastest on this machine (models/layers/linear_kernels.py).

Decoding multiplies 1-16 rows (a step, a verify forward) by each weight, where CPU GEMM
libraries run far below memory bandwidth, by amounts that differ from one CPU to the next.
Training, any forward that tracks gradients, and wide calls (a prefill) take megatron's path.
"""

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_specdec.models.layers.linear_kernels import MAX_ROWS, product, skinny_schedule
from megatron_specdec.models.weight_memory import streamed


def uses_small_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (not torch.is_grad_enabled() or not weight.requires_grad) \
        and x.numel() <= MAX_ROWS * x.shape[-1] and x.device.type == "cpu"


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (no bias) by the product this machine runs fastest for the row count."""
    if uses_small_rows(x, weight):
        return _small_rows(x, weight)
    return F.linear(x, weight)


def _small_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The measured product; where it is the skinny op, over the weight as
    weight_memory.streamed gives it (its 16-bit copy where it has one)."""
    fn = product(weight, x.numel() // max(1, x.shape[-1]))
    schedule = skinny_schedule(fn)
    if schedule is None:
        return fn(x, weight)
    return torch.ops.megatron_specdec.skinny_linear(x, streamed(weight), schedule)


class _SmallRowsMixin:
    def _forward_impl(self, input, weight, bias=None, *args, **kwargs):
        if uses_small_rows(input, weight) and not kwargs.get("sequence_parallel", False):
            out = rows_linear(input, weight)
            return out if bias is None else out + bias
        return super()._forward_impl(input, weight, bias, *args, **kwargs)


class SmallRowsColumnParallelLinear(_SmallRowsMixin, ColumnParallelLinear):
    pass


class SmallRowsRowParallelLinear(_SmallRowsMixin, RowParallelLinear):
    pass


def decode_linear(linear, x: torch.Tensor):
    """(output, bias) of a small-rows Column/RowParallelLinear over `x` as its own forward
    returns them without grad (bias separate under `skip_bias_add`, a row-parallel output
    summed over TP), without the forward's autograd-function and offload bookkeeping: the
    decoding layer (models/layers/decode_layer.py) calls it ~120 times a step. A call too
    wide for the small-row products (a long prefill) takes the module's own forward, as the
    module would: megatron's product there, not F.linear."""
    if not uses_small_rows(x, linear.weight):
        return linear(x)
    out = _small_rows(x, linear.weight)
    if isinstance(linear, RowParallelLinear) and linear.tp_group.size() > 1:
        torch.distributed.all_reduce(out, group=linear.tp_group)
    if linear.skip_bias_add or linear.bias is None:
        return out, linear.bias
    return out + linear.bias, None


def plain_decoding_linear(linear) -> bool:
    """Whether decode_linear computes `linear`'s forward: a small-rows linear without
    sequence parallelism, output gathering or expert communication."""
    return (isinstance(linear, _SmallRowsMixin) and not linear.sequence_parallel
            and not getattr(linear, "gather_output", False)
            and getattr(linear, "input_is_parallel", True)
            and not getattr(linear, "explicit_expert_comm", False))

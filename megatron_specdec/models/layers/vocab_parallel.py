"""Reductions over logits split across tensor-parallel ranks (vocab-parallel), shared by the
draft losses (models/layers/losses.py) and drafting (inference/, methods/)."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from torch import Tensor


@torch.no_grad()
def vocab_parallel_argmax(logits: Tensor, offset: int) -> Tensor:
    """Global argmax [N] of logits split over TP (this rank's slice starts at `offset`);
    ties go to the lowest id."""
    group = ps.get_tensor_model_parallel_group()
    values, index = logits.max(-1)
    if dist.get_world_size(group) == 1:
        return index + offset
    return best_over_ranks(values, index + offset, group)


@torch.no_grad()
def gather_over_ranks(rows, group) -> Tensor:
    """Every TP rank's `rows` (tensors [N], carried as float64: exact for ids and float32
    values) stacked [TP, len(rows), N], in one all_gather."""
    mine = torch.stack([row.double() for row in rows])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered)


def best_of_gathered(stacked: Tensor) -> Tensor:
    """The global argmax ids [N] from gather_over_ranks([values, ids, ...]): the largest
    value, on ties the lowest rank's (the lowest id, as an argmax over the gathered logits
    gives)."""
    best = stacked[:, 0].argmax(0)  # first rank with the max = lowest id
    return stacked[:, 1].gather(0, best[None])[0].long()


def best_over_ranks(values: Tensor, ids: Tensor, group) -> Tensor:
    """The global argmax ids [N] from each TP rank's largest logits `values` [N] at its
    vocabulary ids `ids` [N] (best_of_gathered)."""
    return best_of_gathered(gather_over_ranks([values, ids], group))


def vocab_parallel_gather(logits: Tensor, size: int) -> Tensor:
    """Logits [s, size] of logits [s, b=1, Vp/TP] split over TP (padding past `size` dropped)."""
    return gather_from_tensor_model_parallel_region(
        logits[:, 0].contiguous(), group=ps.get_tensor_model_parallel_group())[:, :size]


def vocab_parallel_log_probs(logits: Tensor, size: int) -> Tensor:
    """Log-softmax [s, size] of logits [s, b=1, Vp/TP] split over TP (padding past `size`)."""
    return vocab_parallel_gather(logits, size).float().log_softmax(-1)

"""AdamW over the draft parameters only, a warmup + cosine schedule (a pure function of the
step, so the step count is the scheduler's whole checkpointed state), and the two collective
steps megatron's DDP/optimizer would do: averaging gradients over data parallel and clipping
by the global norm over the model-parallel group (each TP-replicated parameter counted once).

Only the last pipeline stage holds draft parameters; other stages join the collectives with
empty sums so every rank agrees on the norm.
"""

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from megatron_specdec.distributed import device


def build_optimizer(params, cfg) -> torch.optim.AdamW:
    # foreach=False: the same per-tensor update whatever the TP split (bitwise resumable).
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps, weight_decay=cfg.weight_decay, foreach=False)


def lr_at(step: int, cfg, total_steps: int) -> float:
    """Linear warmup to lr over `warmup_steps`, then cosine to min_lr at `total_steps`
    (or constant)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant" or total_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (total_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def average_data_parallel_grads(params):
    """Mean of the gradients over data-parallel replicas (one flat all-reduce)."""
    group = ps.get_data_parallel_group()
    size = dist.get_world_size(group)
    grads = [p.grad for p in params if p.grad is not None]
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(params, max_norm: float) -> float:
    """Global L2 norm of the draft gradients (scaled down to `max_norm` when above it; 0 = no
    clipping). Returns the norm before clipping."""
    squares = torch.zeros(1, dtype=torch.float64, device=device())
    for p in params:
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
            squares += p.grad.double().pow(2).sum()
    dist.all_reduce(squares, group=ps.get_model_parallel_group())
    norm = float(squares.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm

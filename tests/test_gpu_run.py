"""bench/gpu_run.sh, the one script a lent GPU runs, in its CPU dry run: every check it would
run on the GPU runs here with tiny shapes (or is skipped with its reason), so the script and
the benches it calls cannot rot between the rare runs on a machine with a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# Slow: every check the script runs has its own default test (the CUDA files compile, the
# acceptance bench, the training step, import, validate); this one proves the sequence, so it
# runs with `make test-all` and before each GPU run (docs/guides/gpu.md).
@pytest.mark.slow
def test_gpu_run_dry_run(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", "bench/gpu_run.sh", "--dry-run", "--out", str(out)], cwd=REPO,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable,
                               "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for check in ("cuda_tests", "acceptance_bench", "train_step", "block_drafter", "import_base",
                  "import_draft", "generation_b1", "generation_b8"):
        assert summary[check]["status"] == "ok", (check, summary[check], proc.stdout[-3000:])
    for check in ("build", "memcheck", "ncu"):
        assert summary[check]["status"] == "skipped" and summary[check]["reason"], summary[check]

    step = json.loads((out / "train_step_cpu.json").read_text())
    row = step["rows"][0]
    assert row["seq"] == 64 and row["tokens_per_s"] > 0 and row["model_tflop_per_step"] > 0
    assert row["profile"] and row["profile"][0][1] > 0, "the profiler's costliest kernels are missing"
    dflash = json.loads((out / "train_step_dflash_cpu.json").read_text())
    assert dflash["method"] == "dflash" and dflash["rows"][0]["tokens_per_s"] > 0
    ops = json.loads((out / "acceptance_cpu.json").read_text())
    assert ops["results"] and all(r["same_tokens"] for r in ops["results"])
    for batch in (1, 8):
        report = json.loads((out / f"generation_b{batch}" / "acceptance.json").read_text())
        identical, compared = report["identical_to_greedy"].split("/")
        assert identical == compared == "2", report["identical_to_greedy"]


def test_gpu_run_refuses_unknown_argument():
    proc = subprocess.run(["bash", "bench/gpu_run.sh", "--budgett", "5"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "--budgett" in proc.stderr


def test_step_flops_counts_each_part():
    """The MFU's numerator: doubling s doubles the linear parts and quadruples attention."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from bench_train_step import SHAPES, step_flops
    finally:
        sys.path.pop(0)
    shape = SHAPES["8b"]
    f1, f2, f4 = step_flops(shape, 1024), step_flops(shape, 2048), step_flops(shape, 4096)
    assert 2 * f1 < f2 < 4 * f1 and f4 - 2 * f2 > 2 * (f2 - 2 * f1)  # quadratic term grows
    # a hand count of the linear part at s=1: base layers, base head, 3 x (fc + 7 draft steps)
    h, kv, ffn, v, dv = 4096, 1024, 14336, 128256, 32000
    linear = (2 * 2 * (2 * h * h + 2 * h * kv + 3 * h * ffn) + 2 * h * v
              + 3 * (2 * 3 * h * h + 7 * 2 * (3 * h * h + 4 * h * kv + 3 * h * ffn + h * dv)))
    assert step_flops(shape, 1) == pytest.approx(linear, rel=1e-3)


def test_dflash_step_flops_count_the_blocks():
    """DFlash's draft part at s=4096: 128 blocks of 16 over the scored half; its frozen output
    layer counts forward and input gradient over the 15 scored positions of each block."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from bench_train_step import SHAPES, dflash_draft_flops, step_flops
    finally:
        sys.path.pop(0)
    shape, s = SHAPES["8b"], 4096
    h, kv, ffn, v, n = 4096, 1024, 14336, 128256, 128 * 16
    head = 2 * 2 * 128 * 15 * h * v
    context = 3 * 2 * s * (2 * h * h + 2 * h * kv)
    block = 3 * (2 * n * (2 * h * h + 2 * h * kv + 3 * h * ffn) + 4 * n * (0.75 * s + 16) * h)
    assert dflash_draft_flops(shape, s) == pytest.approx(head + context + block, rel=1e-9)
    base = 2 * (2 * s * (2 * h * h + 2 * h * kv + 3 * h * ffn) + 2 * s * s * h) + 2 * s * h * v
    assert step_flops(shape, s, "dflash") == pytest.approx(base + head + context + block, rel=1e-9)

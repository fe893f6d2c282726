"""Training runs that must agree: a run stopped after step k, or SIGKILLed mid-run, and
resumed equals an uninterrupted one (1e-6, same layout); TP=2, PP=2 and DP=2 give TP=1's
losses (1e-5), and a PP=2 run resumed at TP=2 too (optimizer state resharded); offline
(stored base states) training gives online's losses."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import train_support as ts
from megatron_specdec.training.metrics import read_log

STEPS = 4


@pytest.fixture(scope="module")
def setup(module_tmp):
    root = module_tmp("train_runs")
    model = ts.make_tiny_model(root / "model")
    data = ts.write_conversations(root / "conv.jsonl")
    return root, model, data


@pytest.fixture(scope="module")
def reference(setup):
    root, model, data = setup
    out = root / "reference"
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"category": "math", "turns": ["What is 2 plus 9?"]}\n'
                       '{"category": "writing", "turns": ["Write a line about rain."]}\n')
    summary = ts.run(ts.overrides(model, data, out, **{
        "evaluation.interval": STEPS, "evaluation.prompts": prompts,
        "evaluation.max_new_tokens": 6, "evaluation.draft_tokens": 3}))
    assert summary["steps"] == STEPS, summary
    # The acceptance-length hook ran at the end (an untrained draft on a random base).
    assert summary["acceptance"]["step"] == STEPS
    assert 1.0 <= summary["acceptance"]["acceptance_length"] <= 4.0
    assert set(summary["acceptance"]["categories"]) == {"math", "writing"}
    assert (out / "evaluation" / f"step_{STEPS:07d}" / "acceptance.json").is_file()
    assert all(r["grad_norm"] > 0 for r in read_log(out).values())  # the draft does train
    return ts.losses(out)


def _close(a, b, tol):
    assert len(a) == len(b) == STEPS, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= tol * max(1.0, abs(y)), (a, b)


def test_stop_after_step_3_and_resume(setup, reference):
    root, model, data = setup
    out = root / "killed"
    argv = ts.overrides(model, data, out)
    assert ts.run(argv, kill_after=3) == "killed"
    assert len(ts.losses(out)) == 3
    summary = ts.run(argv)
    assert summary["resumed_from"].endswith("step_0000002"), summary
    assert summary["steps_this_run"] == 2
    _close(ts.losses(out), reference, 1e-6)


@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow),
                                   pytest.param(1, 1, marks=pytest.mark.slow)],
                         ids=["tp2", "pp2", "dp2"])
def test_parallel_layout_matches_tp1(setup, reference, tp, pp):
    """Two processes: TP=2, PP=2 (stopped after step 2, resumed at TP=2), or DP=2."""
    root, model, data = setup
    out = root / f"tp{tp}pp{pp}"
    argv = ts.overrides(model, data, out, **{"parallelism.tp": tp, "parallelism.pp": pp})
    if pp == 2:  # stop after step 2 and resume at TP=2: the checkpoint reshards
        assert ts.run(argv, world_size=2, kill_after=2) == "killed"
        argv = ts.overrides(model, data, out, **{"parallelism.tp": 2})
    summary = ts.run(argv, world_size=2)
    assert summary["steps"] == STEPS, summary
    _close(ts.losses(out), reference, 1e-5)


def test_offline_matches_online(setup, reference):
    root, model, data = setup
    out = root / "offline"
    summary = ts.run(ts.overrides(model, data, out, **{"training.mode": "offline"}))
    assert summary["mode"] == "offline"
    assert (out / "offline_states" / "index.json").is_file()
    _close(ts.losses(out), reference, 1e-5)


@pytest.mark.slow
def test_sigkill_mid_run_and_resume(setup, reference):
    """A real kill: SIGKILL the trainer's process group once step 3 is logged (before the
    step-4 checkpoint), then rerun the same command."""
    root, model, data = setup
    out = root / "sigkill"
    cmd = [sys.executable, "-m", "megatron_specdec.cli.train",
           *ts.overrides(model, data, out)]
    proc = subprocess.Popen(cmd, cwd=root, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while max(read_log(out), default=0) < 3:
            assert proc.poll() is None and time.time() < deadline, "trainer ended early"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "summary.json").exists()  # it really was killed mid-run
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] is not None and summary["steps"] == STEPS
    _close(ts.losses(out), reference, 1e-6)


@pytest.mark.slow
def test_train_from_speculative_checkpoint(setup, reference):
    """model.path may be a speculative checkpoint (the reference run's final/): its draft is
    trained further; a recipe naming another algorithm is refused by key."""
    root, model, data = setup
    final = root / "reference" / "final"
    argv = ts.overrides(final, data, root / "from_final", **{"training.steps": 1})
    summary = ts.run(argv)
    assert summary["steps"] == 1 and summary["algo"] == "eagle3", summary
    result = ts.run(argv + ["draft.algo=medusa", f"output_dir={root / 'from_final_medusa'}"])
    assert result.startswith("error: RecipeError") and "draft.algo" in result, result


@pytest.mark.slow
def test_train_from_base_checkpoint(setup, reference):
    """model.path may be a base megatron checkpoint: its weights are the base (the losses are
    the reference run's, which read the same model from the HF directory)."""
    from megatron_specdec.loading.hf_conversion import hf_to_megatron

    root, model, data = setup
    ckpt = root / "base_ckpt"
    hf_to_megatron(str(model), ckpt, tp=1)
    out = root / "from_base_ckpt"
    summary = ts.run(ts.overrides(ckpt, data, out))
    assert summary["steps"] == STEPS, summary
    _close(ts.losses(out), reference, 1e-5)

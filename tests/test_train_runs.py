"""Training runs that must agree: a run stopped after step k and resumed equals an
uninterrupted one (1e-6, same layout); TP=2 and PP=2 give TP=1's losses (1e-5), and a PP=2
run resumed at TP=2 too (optimizer state resharded); offline (stored base states) training
gives online's losses."""

import pytest

import train_support as ts
from megatron_specdec.training.metrics import read_log

STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_runs")
    model = ts.make_tiny_model(root / "model")
    data = ts.write_conversations(root / "conv.jsonl")
    return root, model, data


@pytest.fixture(scope="module")
def reference(setup):
    root, model, data = setup
    out = root / "reference"
    summary = ts.run(ts.overrides(model, data, out))
    assert summary["steps"] == STEPS, summary
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


@pytest.mark.parametrize("tp,pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)],
                         ids=["tp2", "pp2"])
def test_parallel_layout_matches_tp1(setup, reference, tp, pp):
    root, model, data = setup
    out = root / f"tp{tp}pp{pp}"
    argv = ts.overrides(model, data, out, **{"parallelism.tp": tp, "parallelism.pp": pp})
    if pp == 2:  # stop after step 2 and resume at TP=2: the checkpoint reshards
        assert ts.run(argv, world_size=2, kill_after=2) == "killed"
        argv = ts.overrides(model, data, out, **{"parallelism.tp": 2})
    summary = ts.run(argv, world_size=2)
    assert summary["steps"] == STEPS, summary
    _close(ts.losses(out), reference, 1e-5)


@pytest.mark.slow
def test_offline_matches_online(setup, reference):
    root, model, data = setup
    out = root / "offline"
    summary = ts.run(ts.overrides(model, data, out, **{"training.mode": "offline"}))
    assert summary["mode"] == "offline"
    assert (out / "offline_states" / "index.json").is_file()
    _close(ts.losses(out), reference, 1e-5)

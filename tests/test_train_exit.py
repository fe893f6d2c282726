"""training.exit_duration_mins (Megatron's --exit-duration-in-mins): a run past its wall-time
limit checkpoints the step it reached and stops, still exports final/, and its summary says it
stopped on the limit; a limit it never reaches changes nothing; a negative one is refused by
key. training.exit_interval (Megatron's --exit-interval): a run stops at the first multiple,
checkpointed, and the same command resumes it to the next stop on the unchanged schedule."""

import json

import pytest

import train_support as ts
from megatron_specdec.training import checkpoints, metrics, optimizer
from megatron_specdec.training.recipe import RecipeError, load_recipe


@pytest.fixture(scope="module")
def setup(module_tmp):
    root = module_tmp("exit_duration")
    return root, ts.make_tiny_model(root / "model"), ts.write_conversations(root / "conv.jsonl")


def test_time_limit_checkpoints_the_step_reached_and_stops(setup):
    root, model, data = setup
    out = root / "limited"
    # 1e-6 min: passed before the first step ends; interval 0 would checkpoint only at step 4
    summary = ts.run(ts.overrides(model, data, out, **{"training.exit_duration_mins": 1e-6,
                                                       "checkpointing.interval": 0}))
    assert isinstance(summary, dict), summary
    assert summary["stopped"] == "time_limit" and summary["steps"] == 1, summary
    assert [p.name for p in checkpoints.checkpoints_in(out / "checkpoints")] == \
        [checkpoints.step_dir(out / "checkpoints", 1).name]
    checkpoints.verify(checkpoints.step_dir(out / "checkpoints", 1))
    assert (out / "final").is_dir() and any((out / "final").iterdir())
    written = json.loads((out / "summary.json").read_text())
    assert written["stopped"] == "time_limit" and written["steps"] == 1
    assert len(ts.losses(out)) == 1  # no step ran past the limit


def test_limit_not_reached_runs_all_steps(setup):
    root, model, data = setup
    out = root / "unlimited"
    summary = ts.run(ts.overrides(model, data, out, **{"training.exit_duration_mins": 60,
                                                       "training.steps": 2}))
    assert summary["stopped"] == "steps" and summary["steps"] == 2, summary


def test_exit_interval_stops_at_multiples_and_resumes_on_the_same_schedule(setup):
    root, model, data = setup
    out = root / "interval"
    # no warmup: step 2's lr then tells a schedule of 4 steps from one cut to 2
    argv = ts.overrides(model, data, out, **{"training.exit_interval": 2,
                                            "checkpointing.interval": 0,
                                            "optimizer.warmup_steps": 0})
    first = ts.run(argv)
    assert first["stopped"] == "exit_interval" and first["steps"] == 2, first
    assert [p.name for p in checkpoints.checkpoints_in(out / "checkpoints")] == \
        [checkpoints.step_dir(out / "checkpoints", 2).name]
    assert (out / "final").is_dir() and any((out / "final").iterdir())
    second = ts.run(argv)  # resumes at 2; step 4 is training.steps, where every run ends
    assert second["stopped"] == "steps" and second["steps"] == 4, second
    recipe = load_recipe(None, argv)
    logged = metrics.read_log(out)
    assert sorted(logged) == [1, 2, 3, 4]
    assert [logged[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx(
        [optimizer.lr_at(s, recipe.optimizer, 4) for s in range(4)], rel=1e-12)


def test_negative_limit_refused_by_key():
    with pytest.raises(RecipeError, match=r"key 'training.exit_duration_mins'.*>= 0"):
        load_recipe(None, ["output_dir=/tmp/x", "model.path=default", "data.train=[a.jsonl]",
                           "training.steps=3", "training.exit_duration_mins=-1"])
    with pytest.raises(RecipeError, match=r"key 'training.exit_interval'.*>= 0"):
        load_recipe(None, ["output_dir=/tmp/x", "model.path=default", "data.train=[a.jsonl]",
                           "training.steps=3", "training.exit_interval=-1"])

"""training.profile_steps (Megatron's --profile-step-start/-end): the steps of the window run
under torch.profiler and rank 0 writes the costliest ops to <output_dir>/profile.txt, training
itself unchanged; a window that is not [start, end) is refused by key."""

import pytest

import train_support as ts
from megatron_specdec.training.recipe import RecipeError, load_recipe


def test_profile_window_writes_the_op_table(tmp_path):
    model, data = ts.make_tiny_model(tmp_path / "model"), ts.write_conversations(tmp_path / "c.jsonl")
    plain = ts.run(ts.overrides(model, data, tmp_path / "plain", **{"training.steps": 3}))
    out = tmp_path / "profiled"
    summary = ts.run(ts.overrides(model, data, out, **{"training.steps": 3,
                                                       "training.profile_steps": "[1,3]"}))
    assert summary["steps"] == 3 and summary["final_loss"] == plain["final_loss"], summary
    text = (out / "profile.txt").read_text()
    assert text.startswith("# torch.profiler, steps 2-3, sorted by self_cpu_time_total")
    assert "aten::mm" in text or "aten::addmm" in text  # the draft's matmuls were recorded
    assert not (tmp_path / "plain" / "profile.txt").exists()


@pytest.mark.parametrize("window", ["[3]", "[2,2]", "[-1,2]"])
def test_bad_window_refused_by_key(window):
    with pytest.raises(RecipeError, match=r"key 'training.profile_steps'.*\[start, end\)"):
        load_recipe(None, ["output_dir=/tmp/x", "model.path=default", "data.train=[a.jsonl]",
                           "training.steps=3", f"training.profile_steps={window}"])

"""Recipe schema: every shipped recipe loads; an unknown key or a wrong type, in the YAML or
on the command line, is an error naming the full key; range checks and the draft module's
own keys name theirs; the CLI prints one error line and exits 2."""

import subprocess
from contextlib import nullcontext
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_specdec.training.build import draft_config
from megatron_specdec.training.recipe import RecipeError, load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
REQUIRED = ["output_dir=/tmp/x", "model.path=default", "data.train=[a.jsonl]",
            "training.steps=3"]


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_load(path):
    user = ["output_dir=/tmp/x", "model.path=/models/m", "data.train=[/data/d.jsonl]"]
    needs_paths = "???" in path.read_text()
    with pytest.raises(RecipeError, match="data.train, model.path") if needs_paths else \
            nullcontext():
        load_recipe(path, [])  # the 8B recipes need the user's paths
    recipe = load_recipe(path, user)
    assert recipe.training.steps > 0 and recipe.data.train == ["/data/d.jsonl"]


def test_overrides_apply_with_types():
    r = load_recipe(None, REQUIRED + ["optimizer.lr=3e-4", "parallelism.tp=2",
                                      "draft.config.ttt_steps=5", "data.pack=false"])
    assert r.optimizer.lr == 3e-4 and r.parallelism.tp == 2 and r.data.pack is False
    assert r.draft.config == {"ttt_steps": 5}


@pytest.mark.parametrize("override,key", [
    ("training.stepz=3", "training.stepz"),
    ("optimiser.lr=1", "optimiser"),
    ("training.steps=abc", "training.steps"),
    ("optimizer.lr=fast", "optimizer.lr"),
    ("data.pack=maybe", "data.pack"),
])
def test_bad_override_names_key(override, key):
    with pytest.raises(RecipeError, match=f"key '{key}'"):
        load_recipe(None, REQUIRED + [override])


def test_bad_yaml_names_key(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("output_dir: /tmp/x\nmodel: {path: default}\ndata:\n  train: [a.jsonl]\n"
                    "  max_len: 5\ntraining:\n  steps: 3\n")
    with pytest.raises(RecipeError, match=rf"recipe {path}: key 'data.max_len'"):
        load_recipe(path)
    path.write_text("output_dir: /tmp/x\ndata:\n  train: [a.jsonl]\ntraining:\n  steps: [1]\n")
    with pytest.raises(RecipeError, match="key 'training.steps'"):
        load_recipe(path)


@pytest.mark.parametrize("override,key", [
    ("optimizer.lr=-1", "optimizer.lr"),
    ("training.global_batch_size=3", "training.global_batch_size"),
    ("draft.algo=eagle2", "draft.algo"),
    ("optimizer.decay=linear", "optimizer.decay"),
    ("evaluation.interval=5", "evaluation.prompts"),
    ("data.length_bucket=0", "data.length_bucket"),
])
def test_range_checks_name_key(override, key):
    extra = ["training.micro_batch_size=2"] if "global" in override else []
    with pytest.raises(RecipeError, match=f"key '{key}'"):
        load_recipe(None, REQUIRED + extra + [override])


def test_missing_required_keys_named():
    with pytest.raises(RecipeError, match="data.train, model.path, output_dir, training.steps"):
        load_recipe(None, [])


def test_draft_config_keys_checked_by_name():
    hf = SimpleNamespace(num_hidden_layers=4, vocab_size=512)
    recipe = load_recipe(None, REQUIRED + ["draft.config.ttt_stepz=3"])
    with pytest.raises(RecipeError, match="draft.config.*'ttt_stepz'"):
        draft_config(recipe, hf)
    recipe = load_recipe(None, REQUIRED + ["draft.config.ttt_steps=x"])
    with pytest.raises(RecipeError, match="draft.config.*ttt_steps must be an integer"):
        draft_config(recipe, hf)


def test_warm_start_takes_training_keys_and_refuses_shape_keys():
    """Over a trained draft (model.path a speculative checkpoint) the recipe's resumable keys
    apply; a key that shapes the draft must equal the checkpoint's or is refused by name."""
    hf = SimpleNamespace(num_hidden_layers=30, vocab_size=49152)
    stored = {"algo": "dflash", "config": {
        "block_size": 8, "num_layers": 1, "k_norm_trainable": True, "mask_token_id": 49151,
        "target_layer_ids": [1, 8, 14, 20, 27], "anchors_per_sequence": 8,
        "loss_decay_gamma": 4.0}}
    base = REQUIRED + ["draft.algo=dflash"]
    recipe = load_recipe(None, base + ["draft.config.anchors_per_sequence=64",
                                       "draft.config.block_size=8"])
    cfg = draft_config(recipe, hf, stored)
    assert (cfg.anchors_per_sequence, cfg.block_size, cfg.loss_decay_gamma) == (64, 8, 4.0)
    assert draft_config(load_recipe(None, base), hf, stored).anchors_per_sequence == 8
    recipe = load_recipe(None, base + ["draft.config.block_size=4"])
    with pytest.raises(RecipeError, match="'draft.config.block_size': 4, but the draft .* has 8; "
                                          "over a trained draft only anchors_per_sequence, "
                                          "loss_decay_gamma may change"):
        draft_config(recipe, hf, stored)
    recipe = load_recipe(None, base + ["draft.config.anchors_per_sequence=0"])
    with pytest.raises(RecipeError, match="anchors_per_sequence must be an integer >= 1"):
        draft_config(recipe, hf, stored)
    recipe = load_recipe(None, base + ["draft.config.anchorz=3"])
    with pytest.raises(RecipeError, match=r"'draft.config': unknown dflash config key\(s\) "
                                          r"'anchorz'; valid keys"):
        draft_config(recipe, hf, stored)


def test_cli_reports_key_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_specdec.cli.train", *REQUIRED, "training.stepz=1"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: command-line override: key 'training.stepz'" in proc.stderr

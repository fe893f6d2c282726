"""`model.dtype: auto` (training/dtype_choice.py): bfloat16 only where it runs a training-sized
linear clearly faster than float32, rank 0's choice on every rank, concrete dtypes untouched,
and the recipe key checked."""

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.training import dtype_choice, load_recipe
from megatron_specdec.training.recipe import RecipeError


REQUIRED = ["output_dir=unused", "model.path=default", "data.train=[unused.jsonl]",
            "training.steps=1"]


def timings(monkeypatch, fp32: float, bf16: float):
    monkeypatch.setattr(dtype_choice, "linear_step_seconds",
                        lambda dtype, **_: fp32 if dtype == torch.float32 else bf16)


@pytest.mark.parametrize("fp32,bf16,expected", [
    (10.0, 5.0, "bfloat16"),   # bf16 instructions: twice as fast
    (10.0, 9.0, "float32"),    # a near tie keeps float32
    (10.0, 250.0, "float32"),  # no bf16 instructions: converted to float32 and back
])
def test_auto_takes_bfloat16_only_where_it_is_clearly_faster(monkeypatch, fp32, bf16, expected):
    timings(monkeypatch, fp32, bf16)
    assert dtype_choice.measure() == expected


def test_the_measurement_times_real_products_in_each_dtype():
    assert dtype_choice.linear_step_seconds(torch.float32, tokens=8, hidden=16, features=32) > 0
    assert dtype_choice.linear_step_seconds(torch.bfloat16, tokens=8, hidden=16, features=32) > 0


def test_resolve_replaces_auto_and_leaves_a_dtype_as_written(monkeypatch):
    timings(monkeypatch, 10.0, 250.0)
    recipe = load_recipe(None, REQUIRED + ["model.dtype=auto"])
    dtype_choice.resolve(recipe)
    assert recipe.model.dtype == "float32"
    recipe = load_recipe(None, REQUIRED + ["model.dtype=bfloat16"])
    dtype_choice.resolve(recipe)
    assert recipe.model.dtype == "bfloat16"


def test_a_bad_dtype_names_the_key():
    with pytest.raises(RecipeError, match=r"model.dtype.*'fp8'.*auto"):
        load_recipe(None, REQUIRED + ["model.dtype=fp8"])


def _choose_worker(out):
    distributed.initialize(1, 1)
    rank = torch.distributed.get_rank()
    # Rank 1 would measure the other way: it must still train in rank 0's dtype.
    fast_bf16 = rank == 0
    dtype_choice.linear_step_seconds = (
        lambda dtype, **_: (10.0 if dtype == torch.float32 else (5.0 if fast_bf16 else 50.0)))
    torch.save(dtype_choice.choose(), f"{out}.{rank}")


def test_every_rank_takes_rank_0s_choice(tmp_path):
    out = tmp_path / "choice"
    distributed.spawn(_choose_worker, 2, str(out))
    assert [torch.load(f"{out}.{r}") for r in (0, 1)] == ["bfloat16", "bfloat16"]

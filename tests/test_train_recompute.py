"""The recipe key training.recompute reaches the EAGLE3 draft's TransformerConfig (and not the
base's), recomputing the draft layer changes neither the loss nor any draft gradient, and a
bad value or a draft without that layer is refused naming the key."""

import pytest
import torch

import train_support as ts
from megatron_specdec import distributed
from megatron_specdec.training.recipe import RecipeError, load_recipe

REQUIRED = ["output_dir=/tmp/x", "model.path=default", "data.train=[a.jsonl]",
            "training.steps=3"]


@pytest.fixture(scope="module")
def setup(module_tmp):
    root = module_tmp("recompute")
    distributed.initialize(1, 1)
    yield ts.make_tiny_model(root / "model"), ts.write_conversations(root / "conv.jsonl"), root
    distributed.destroy()  # leave no process group behind for other test modules


def _loss_and_grads(setup, recompute: bool):
    from megatron_specdec.training.build import build_speculative

    model_dir, data, root = setup
    recipe = load_recipe(None, ts.overrides(model_dir, data, root / "out",
                                            **{"training.recompute": str(recompute).lower()}))
    model = build_speculative(recipe)[0]
    assert model.draft.recompute is recompute
    assert model.draft.config.recompute_granularity == ("full" if recompute else None)
    assert model.base.config.recompute_granularity is None  # the frozen base is untouched
    g = torch.Generator().manual_seed(5)
    vocab = model.draft.target_ids()  # targets outside the draft vocabulary add no loss
    ids = vocab[torch.randint(0, len(vocab), (2, 32), generator=g)]
    loss_mask = (torch.rand(2, 32, generator=g) > 0.3).long()
    loss = model(ids, loss_mask)["loss_sum"]
    named = [(n, p) for n, p in model.draft.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named])
    return loss.detach(), dict(zip([n for n, _ in named], grads))


def test_recompute_key_reaches_the_draft_and_changes_nothing(setup):
    loss, grads = _loss_and_grads(setup, False)
    loss_r, grads_r = _loss_and_grads(setup, True)
    assert float(loss) > 0
    torch.testing.assert_close(loss_r, loss, rtol=0, atol=1e-6)
    assert grads.keys() == grads_r.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_r[name], grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("override,extra", [
    ("training.recompute=maybe", []),
    ("training.recompute=true", ["draft.algo=medusa"]),
])
def test_bad_recompute_names_the_key(override, extra):
    with pytest.raises(RecipeError, match="key 'training.recompute'"):
        load_recipe(None, REQUIRED + extra + [override])

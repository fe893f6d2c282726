"""Distilling a draft GPT with the trainer (`draft.algo: draft_model`): the loss is the
cross-entropy of the draft's next-token distribution against the base's (forward KL plus the
base entropy) with its gradient; a run trains the depth-pruned draft (its loss falls, its
weights move) and leaves a plain GPT checkpoint the draft-model drafter reads; TP=2 and PP=2
of the base (PP=2 stopped and resumed at TP=2) give TP=1's losses; bad recipes are named."""

import re
import subprocess
import sys

import pytest
import torch

import train_support as ts

STEPS = 4


@pytest.fixture(scope="module")
def setup(module_tmp):
    root = module_tmp("distill")
    model = ts.make_tiny_model(root / "model")
    data = ts.write_conversations(root / "conv.jsonl")
    student = root / "student"
    subprocess.run([sys.executable, "checkpoint_tools/prune_depth.py", "--model", str(model),
                    "--num-layers", "2", "--data", str(data), "--num-tokens", "64",
                    "--out", str(student)], check=True, capture_output=True)
    return root, model, data, student


def argv(setup, out, **extra):
    root, model, data, student = setup
    base = [a for a in ts.overrides(model, data, root / out) if not a.startswith("draft.")]
    extra = {"draft.algo": "draft_model", "draft.config.model": student, "optimizer.lr": 1e-3,
             **extra}
    return base + [f"{k}={v}" for k, v in extra.items()]


@pytest.fixture(scope="module")
def reference(setup):
    summary = ts.run(argv(setup, "reference"))
    assert summary["steps"] == STEPS and summary["algo"] == "draft_model", summary
    return summary, ts.losses(setup[0] / "reference")


def test_distill_loss_is_cross_entropy_to_the_base():
    from megatron_specdec import distributed
    from megatron_specdec.models.layers import losses

    distributed.initialize(1, 1)
    torch.manual_seed(0)
    base = torch.randn(5, 40) * 3
    draft = torch.randn(5, 40, requires_grad=True)
    out = losses.distill_loss(draft, base, 37, group=None)  # ids 37-39 are padding
    p = base[:, :37].softmax(-1)
    expected = -(p * draft[:, :37].log_softmax(-1)).sum()
    torch.testing.assert_close(out["loss_sum"], expected, rtol=1e-6, atol=1e-5)
    out["loss_sum"].backward()
    torch.testing.assert_close(draft.grad[:, :37], draft[:, :37].softmax(-1).detach() - p)
    assert float(draft.grad[:, 37:].abs().sum()) == 0.0
    same = losses.distill_loss(base.clone(), base, 37, group=None)  # a draft equal to its base
    entropy = -(p * p.log()).sum()
    torch.testing.assert_close(same["loss_sum"], entropy, rtol=1e-6, atol=1e-5)
    assert float(same["step_correct"][0]) == 5 == float(same["num_tokens"])


def test_distillation_trains_the_draft_and_writes_a_gpt_checkpoint(setup, reference):
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.methods.draft_model.proposer import check_draft_checkpoint
    from megatron_specdec.training.metrics import read_log

    root, _, _, student = setup
    summary, losses = reference
    assert losses[-1] < losses[0], losses
    assert all(r["grad_norm"] > 0 for r in read_log(root / "reference").values())
    final = root / "reference" / "final"
    meta = check_draft_checkpoint(final, 49152, student / checkpoint.TOKENIZER_DIR)
    assert "draft" not in meta and meta["distilled"]["steps"] == STEPS, meta
    assert meta["pruned_from"] == checkpoint.read_meta(student)["pruned_from"]
    before = checkpoint.load_plain_tensors(student)
    after = checkpoint.load_plain_tensors(final)
    assert set(before) == set(after)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert "embedding.word_embeddings.weight" in moved and len(moved) > len(before) // 2, moved


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_base_layout_matches_tp1(setup, reference, tp, pp):
    """The draft GPT is whole on each last-stage rank: a TP=2 or PP=2 base gives TP=1's losses;
    PP=2 stopped after step 2 resumes at TP=2 (the replicated draft's checkpoint reloads)."""
    out = f"tp{tp}pp{pp}"
    args = argv(setup, out, **{"parallelism.tp": tp, "parallelism.pp": pp})
    if pp == 2:
        assert ts.run(args, world_size=2, kill_after=2) == "killed"
        args = argv(setup, out, **{"parallelism.tp": 2})
    summary = ts.run(args, world_size=2)
    assert summary["steps"] == STEPS, summary
    got, want = ts.losses(setup[0] / out), reference[1]
    assert len(got) == STEPS and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (
        got, want)


@pytest.mark.parametrize("extra,match", [
    ({"draft.config.model": "null"}, "draft.config.*needs 'model'"),
    ({"draft.config.ttt_steps": 2}, "unknown draft_model config key.*ttt_steps"),
    ({"evaluation.interval": 2, "evaluation.prompts": "p.jsonl"},
     "evaluation.interval.*draft_model"),
    ({"draft.config.model": "{model}"}, "draft.config.model.*HF directory"),
])
def test_bad_recipes_are_named(setup, extra, match):
    """In this process: the recipe, the draft config and the draft checkpoint are checked
    before any checkpoint is read collectively."""
    from megatron_specdec import distributed
    from megatron_specdec.training import load_recipe
    from megatron_specdec.training.build import build_speculative
    from megatron_specdec.training.recipe import RecipeError

    extra = {k: str(v).format(model=setup[1]) for k, v in extra.items()}
    with pytest.raises(RecipeError, match=match):
        distributed.initialize(1, 1)
        build_speculative(load_recipe(None, argv(setup, "bad", **extra)))

"""Draft-target speculation on a small seeded random Llama: a separate draft GPT (the target
pruned to some of its layers) gives plain greedy's tokens token for token at TP=1, TP=2 and
PP=2, with fixed and adaptive draft length; the draft is saved as a checkpoint at the
layout under test and read whole on each last-stage rank. A draft equal to the target is
accepted every time (its cache keeps accepted drafts and rewinds the rest correctly)."""

import pytest
import torch

from megatron_specdec import distributed
from test_speculative_generation import HF, PROMPT, build
from workers import is_writer

K, NEW = 4, 24
KEEP = [0, 1]  # the target layers the draft keeps: accepts some drafts, rejects others
THRESHOLD = 0.02  # around the random draft's top probabilities: adaptive chains vary


def draft_config(keep):
    from transformers import LlamaConfig

    return LlamaConfig(**{**HF, "num_hidden_layers": len(keep)})


def draft_model(keep):
    """This rank's stage of a GPT holding the target's embedding, head and layers `keep`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model

    torch.manual_seed(0)  # the target's weights (test_speculative_generation.build)
    state = LlamaForCausalLM(LlamaConfig(**HF)).state_dict()
    pruned = {}
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            if int(layer) in keep:
                pruned[f"model.layers.{keep.index(int(layer))}.{rest}"] = tensor
        else:
            pruned[name] = tensor
    config = draft_config(keep)
    model = build_model(config)
    load_hf_into_model(model, config, pruned)
    return model.eval(), config


def save_draft(path, keep, tokenizer_dir=None):
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.loading.hf_conversion import base_meta

    model, config = draft_model(keep)
    checkpoint.save_checkpoint(model, path, base_meta(config, model, torch.float32, "local"),
                               tokenizer_dir=tokenizer_dir)


def identity_worker(tp, pp, draft_dir, out_file):
    from megatron_specdec.inference.draft_policy import DraftPolicy
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate

    distributed.initialize(tp, pp)
    save_draft(draft_dir, KEEP)  # at this layout; the drafter reads it whole
    model = build("eagle3")
    greedy = plain_generate(model.base, [PROMPT], NEW, HF["vocab_size"])[0]
    generator = SpeculativeGenerator(model, K, policy="fixed", drafter_kind="draft_model",
                                     draft_model=draft_dir)
    results = {"fixed": generator.generate(PROMPT, NEW)}
    generator.policy = DraftPolicy(K, THRESHOLD)
    results["adaptive"] = generator.generate(PROMPT, NEW)
    if is_writer():
        torch.save({"greedy": greedy, **results}, out_file)


# TP=2 and PP=2 are slow: test_speculative_batch runs the draft-model drafter, fixed and
# adaptive, at both layouts with each row equal to plain greedy.
@pytest.mark.parametrize("tp,pp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow),
                                   pytest.param(1, 2, marks=pytest.mark.slow)])
def test_draft_model_speculation_equals_greedy(tp, pp, tmp_path):
    out = tmp_path / "out.pt"
    distributed.spawn(identity_worker, tp * pp, tp, pp, str(tmp_path / "draft"), str(out))
    results = torch.load(out, weights_only=False)
    for policy in ("fixed", "adaptive"):
        assert results[policy].tokens == results["greedy"], policy
    fixed, adaptive = results["fixed"], results["adaptive"]
    assert set(fixed.drafted) == {K}
    assert 0 < sum(fixed.accepted) < K * len(fixed.accepted), fixed.accepted  # kept, rewound
    assert len(set(adaptive.drafted)) > 1, adaptive.drafted


def test_a_draft_equal_to_the_target_is_always_accepted():
    from megatron_specdec.methods.draft_model.proposer import DraftModelDrafter
    from megatron_specdec.inference.generator import SpeculativeGenerator

    distributed.initialize(1, 1)
    model = build("eagle3")
    target, _ = draft_model([0, 1, 2, 3])
    generator = SpeculativeGenerator(model, K, policy="fixed", drafter_kind="draft_model",
                                     drafter=DraftModelDrafter(target, HF["vocab_size"]))
    result = generator.generate(PROMPT, NEW)
    assert result.accepted == [K] * len(result.accepted), result.accepted

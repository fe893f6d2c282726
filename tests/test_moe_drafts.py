"""Drafts on a mixture-of-experts base (a tiny random Mixtral, every layer MoE, so the EAGLE3
aux hidden states are MoE layers' outputs): an EAGLE3 draft attaches with `convert` and trains
a few steps at EP=2 with the losses of EP=1; the frozen base, routers included, is bitwise
unchanged; speculative generation with EAGLE3 and with n-gram drafting equals plain greedy at
EP=1 and EP=2."""

import types

import pytest
import torch

import moe_models
from megatron_specdec import distributed

EAGLE = {"draft_vocab_size": 300, "eagle_aux_hidden_state_layer_ids": [0, 1], "ttt_steps": 3}
SEQ, MICRO_BATCH, NUM_MICRO, VOCAB, STEPS = 16, 2, 2, 512, 3
K, NEW = 3, 16
PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist()
ADAM = types.SimpleNamespace(lr=3e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             weight_decay=0.0, clip_grad=1.0)


def batches():
    """The same batch every step: the draft fits it, so the loss must fall."""
    g = torch.Generator().manual_seed(100)
    out = []
    for _ in range(NUM_MICRO):
        mask = torch.ones(MICRO_BATCH, SEQ)
        mask[:, :3] = 0
        out.append({"input_ids": torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g),
                    "loss_mask": mask})
    return out


def draft_worker(ep, hf_dir, out_file):
    """EP x data parallel ranks, every rank fed the same batches (so the data-parallel mean
    gradient is EP=1's): per-step losses, the base's parameters before and after training,
    and greedy / EAGLE3 / n-gram generations of the trained model."""
    from megatron.core import parallel_state as ps

    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.loading.hf_conversion import model_from_hf
    from megatron_specdec.models.speculative import convert
    from megatron_specdec.training.optimizer import DraftOptimizer
    from megatron_specdec.training.schedule import forward_backward, reduce_reports

    distributed.initialize(1, 1, ep=ep)
    base, hf = model_from_hf(hf_dir)
    model = convert(base, "eagle3", EAGLE, hf_config=hf)
    before = {n: p.detach().clone() for n, p in model.base.named_parameters()}
    opt = DraftOptimizer(model.trainable_parameters(), ADAM, torch.float32)
    model.train()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(reduce_reports(forward_backward(model, batches()))["loss"])
        opt.step(ADAM.lr)
    model.eval()
    base_grads = [n for n, p in model.base.named_parameters() if p.requires_grad or p.grad is not None]
    changed = [n for n, p in model.base.named_parameters() if not torch.equal(p, before[n])]
    greedy = plain_generate(model.base, [PROMPT], NEW + K + 1, hf.vocab_size)[0][:NEW]
    generated = {kind: SpeculativeGenerator(model, K, drafter_kind=kind, policy="fixed")
                 .generate(PROMPT, NEW) for kind in ("eagle3", "ngram")}
    if ps.get_data_parallel_rank() == 0:
        torch.save({"losses": losses, "base_params": sorted(before), "changed": changed,
                    "base_grads": base_grads, "greedy": greedy,
                    "tokens": {k: g.tokens for k, g in generated.items()},
                    "accepted": {k: g.accepted for k, g in generated.items()}}, out_file)


@pytest.fixture(scope="module")
def results(module_tmp):
    root = module_tmp("moe_drafts")
    moe_models.save_random("mixtral", root / "hf")
    out = {}
    for ep in (1, 2):
        distributed.spawn(draft_worker, ep, ep, str(root / "hf"), str(root / f"ep{ep}.pt"))
        out[ep] = torch.load(root / f"ep{ep}.pt", weights_only=False)
    return out


def test_eagle3_trains_on_moe_base_at_ep2_as_at_ep1(results):
    one, two = results[1]["losses"], results[2]["losses"]
    assert len(one) == STEPS and 1.0 < one[0] < 20.0, one  # a real loss over 300 draft tokens
    assert one[-1] < one[0], one  # it learns
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)


def test_frozen_moe_base_and_router_unchanged_after_training(results):
    for ep in (1, 2):
        params = results[ep]["base_params"]
        assert any(n.endswith("mlp.router.weight") for n in params), params
        assert any(".local_experts." in n for n in params), params
        assert results[ep]["changed"] == [] and results[ep]["base_grads"] == []


@pytest.mark.parametrize("ep", [1, 2])
def test_speculative_on_moe_base_equals_greedy(results, ep):
    got = results[ep]
    for kind in ("eagle3", "ngram"):
        assert got["tokens"][kind] == got["greedy"], (kind, got["tokens"][kind], got["greedy"])
    assert results[1]["greedy"] == results[2]["greedy"]

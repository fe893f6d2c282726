"""DFlash at TP=2, PP=2 and TP2xPP2 against one process: same loss, per-position statistics
and draft gradients (float32, 1e-5); the initial draft is the same on every layout; the base
stays frozen. The base is SmolLM2-shaped in miniature (3 query groups, zero-padded to 4 at
TP=2; a 500-token vocabulary padded to 512), every layout loading the same HF weights.
"""

import pytest
import torch

from megatron_specdec import distributed
from workers import is_writer

from test_eagle3_parallel import MICRO_BATCH, NUM_MICRO, VOCAB, batches, tiny_hf_config  # same base

DFLASH = {"block_size": 4, "anchors_per_sequence": 3, "target_layer_ids": [0, 1, 2],
          "num_layers": 2}


def build(hf_draft=None):
    """This rank's base + DFlash model; the draft from HF-named tensors when given."""
    from transformers import LlamaForCausalLM

    from megatron_specdec import registry
    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.methods.dflash import hf_weights
    from megatron_specdec.models.provider import build_model
    from megatron_specdec.models.speculative import attach


    hf = tiny_hf_config()
    torch.manual_seed(0)
    hf_state = LlamaForCausalLM(hf).state_dict()
    base = build_model(hf)
    load_hf_into_model(base, hf, hf_state)
    cfg = registry.parse_config("dflash", dict(DFLASH), hf.num_hidden_layers, VOCAB)
    model = attach(base, cfg, hf)
    if hf_draft is not None and model.draft is not None:
        hf_weights.load_hf_state(model.draft, cfg, model.draft.geometry, hf_draft)
    return model


def random_hf_draft():
    """The seeded initial draft, perturbed so norms and the mask embedding are not constant."""
    from megatron_specdec.methods.dflash import hf_weights

    model = build()
    state = hf_weights.gather_hf_state(model.draft, model.spec_config, model.draft.geometry)
    g = torch.Generator().manual_seed(3)
    return {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in state.items()}


def run(hf_draft):
    from megatron_specdec.methods.dflash import hf_weights
    from megatron_specdec.training.schedule import forward_backward, reduce_reports

    model = build(hf_draft)
    reports = forward_backward(model, batches())
    result = {"base_grads": sum(p.grad is not None for p in model.base.parameters()),
              "last": model.post_process}
    fresh = build()
    if model.post_process:
        cfg, geo = model.spec_config, model.draft.geometry
        result["fresh"] = hf_weights.gather_hf_state(fresh.draft, cfg, geo)
        result["report"] = reduce_reports(reports)
        result["grads"] = hf_weights.gather_hf_state(model.draft, cfg, geo, grads=True)
    return result


def layout_worker(tp, pp, draft, out_file):
    distributed.initialize(tp, pp)
    result = run(draft)
    if is_writer():
        torch.save(result, out_file)


def _reference_worker(out_file):
    distributed.initialize(1, 1)
    draft = random_hf_draft()
    torch.save({"draft": draft, "result": run(draft)}, out_file)


@pytest.fixture(scope="module")
def reference(module_tmp):
    out = module_tmp("ref") / "ref.pt"
    distributed.spawn(_reference_worker, 1, str(out))
    return torch.load(out, weights_only=False)


def _close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64),
                          torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=tol)


def test_reference_is_meaningful(reference):
    res = reference["result"]
    rep = res["report"]
    assert res["base_grads"] == 0
    assert len(rep["step_loss"]) == DFLASH["block_size"] - 1
    assert rep["num_tokens"] == NUM_MICRO * MICRO_BATCH * DFLASH["anchors_per_sequence"]
    assert all(x > 0 for x in rep["step_loss"])
    for name, grad in res["grads"].items():
        assert grad.abs().max() > 0, name


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_layouts_match_single_process(reference, tmp_path, tp, pp):
    out = tmp_path / "out.pt"
    distributed.spawn(layout_worker, tp * pp, tp, pp, reference["draft"], str(out))
    got, want = torch.load(out, weights_only=False), reference["result"]
    assert got["base_grads"] == 0
    for key in ("loss", "step_loss", "accuracy", "num_tokens"):
        assert _close(got["report"][key], want["report"][key]), (key, got["report"], want["report"])
    assert set(got["fresh"]) == set(want["fresh"])
    for name, t in want["fresh"].items():  # 3 query groups at TP=1, 4 (one zero) at TP=2
        assert torch.equal(got["fresh"][name], t), name
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        assert _close(got["grads"][name], grad), name

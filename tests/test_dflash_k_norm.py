"""`k_norm_trainable: false`: a multi-layer DFlash draft trains with every layer's key RMSNorm
gain held at 1 (no gradient, not in the optimizer, exported as ones), so vLLM's CPU build,
which normalises all layers' context keys with layer 0's k_norm, computes what was trained;
everything else in the draft still learns."""

import torch

from megatron_specdec import distributed
from workers import is_writer

import test_dflash_parallel as tdp


def _worker(out_file):
    from megatron_specdec.methods.dflash import hf_weights
    from megatron_specdec.training.schedule import forward_backward

    distributed.initialize(1, 1)
    tdp.DFLASH["k_norm_trainable"] = False  # this worker process's copy of the config
    model = tdp.build()
    forward_backward(model, tdp.batches())
    trainable = {id(p) for p in model.trainable_parameters()}
    k_norms = [layer.self_attention.k_layernorm.weight for layer in model.draft.layers]
    q_norms = [layer.self_attention.q_layernorm.weight for layer in model.draft.layers]
    state = hf_weights.gather_hf_state(model.draft, model.spec_config, model.draft.geometry)
    if is_writer():
        torch.save({
            "k_trainable": [id(w) in trainable for w in k_norms],
            "k_grads": [w.grad is not None for w in k_norms],
            "q_grads": [w.grad is not None and bool(w.grad.abs().sum() > 0) for w in q_norms],
            "k_exported": [state[f"layers.{i}.self_attn.k_norm.weight"]
                           for i in range(len(k_norms))],
        }, out_file)


def test_k_norm_held_at_one_while_the_rest_learns(tmp_path):
    out = tmp_path / "result.pt"
    distributed.spawn(_worker, 1, str(out))
    r = torch.load(out)
    assert len(r["k_exported"]) == tdp.DFLASH["num_layers"] == 2
    assert r["k_trainable"] == [False, False] and r["k_grads"] == [False, False]
    assert r["q_grads"] == [True, True]
    assert all(torch.equal(w, torch.ones_like(w)) for w in r["k_exported"])

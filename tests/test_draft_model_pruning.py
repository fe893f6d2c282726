"""Depth pruning (megatron_specdec/methods/draft_model/pruning.py) on a small seeded random Llama: a layer
made an identity (its output projections zeroed) scores zero block influence and is the one
dropped, and the pruned model then generates exactly the full model's greedy tokens (the
kept layers' weights and order carried over); a bad layer count is named."""

import pytest
import torch

from megatron_specdec import distributed
from test_draft_model_generation import draft_model
from test_speculative_generation import HF, PROMPT


def test_identity_layer_is_pruned_and_output_unchanged():
    from megatron_specdec.methods.draft_model.pruning import layer_importance, layers_to_keep, prune
    from megatron_specdec.inference.generation import plain_generate

    distributed.initialize(1, 1)
    model, config = draft_model([0, 1, 2, 3])
    layer = model.decoder.layers[2]
    with torch.no_grad():  # the residual stream passes layer 2 unchanged
        layer.self_attention.linear_proj.weight.zero_()
        layer.mlp.linear_fc2.weight.zero_()
    importance = layer_importance(model, [PROMPT, PROMPT[:7]], HF["vocab_size"])
    assert float(importance[2]) < 1e-9 and bool((importance[[0, 1, 3]] > 1e-3).all()), importance
    keep = layers_to_keep(importance, 3)
    assert keep == [0, 1, 3]
    pruned, pruned_config = prune(model, config, keep)
    assert pruned_config.num_hidden_layers == 3 and len(pruned.decoder.layers) == 3
    full = plain_generate(model, [PROMPT], 12, HF["vocab_size"])
    assert plain_generate(pruned, [PROMPT], 12, HF["vocab_size"]) == full
    with pytest.raises(ValueError, match="--num-layers 5"):
        layers_to_keep(importance, 5)

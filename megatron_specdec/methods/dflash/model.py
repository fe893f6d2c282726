"""Attaching a DFlash draft to a base stage, and the logits it reads through the base.

The base's stages run as for EAGLE3 (aux_capture carries the captured layers and the token
embeddings to the last stage); the draft and its loss run on the last stage. The draft
starts from one seed in the HF layout (hf_weights.initial_state), so every TP/PP layout
begins with the same draft, padded query groups zero.
"""

import torch

from megatron.core import parallel_state as ps
from megatron.core.transformer.spec_utils import build_module

from megatron_specdec.distributed import device
from megatron_specdec.methods.dflash import hf_weights
from megatron_specdec.methods.dflash.layers import dflash_module_spec
from megatron_specdec.models.layers.small_rows_linear import rows_linear


def build_draft(model, cfg, vocab_size: int, real_query_groups: int, seed: int = 1234,
                recompute: bool = False, tokenizer_dir=None):
    """This stage's DFlash module (None before the last stage), drawn from `seed`.
    (`recompute`, `tokenizer_dir`: part of the registry's attach signature; a one-forward
    draft has nothing to recompute.)"""
    if not model.post_process:
        return None
    draft = build_module(dflash_module_spec(cfg), config=model.config,
                         num_aux=len(cfg.aux_layer_ids)).to(device())
    geo = hf_weights.geometry(model.config, real_query_groups)
    hf_weights.load_hf_state(draft, cfg, geo, hf_weights.initial_state(model.config, cfg, geo, seed))
    draft.geometry = geo
    if not cfg.k_norm_trainable:  # the gains stay at their initial 1 (see config.py)
        for layer in draft.layers:
            layer.self_attention.k_layernorm.weight.requires_grad_(False)
    return draft


def output_weight(spec_model):
    """This rank's slice of the base's output weight (the embedding's where tied), [Vp/TP, h]."""
    base = spec_model.base
    return (base.shared_embedding_or_output_weight() if base.share_embeddings_and_output_weights
            else base.output_layer.weight)


def draft_logits(spec_model, hidden):
    """The base's output layer over draft hidden states [..., h] -> this rank's vocabulary
    slice [..., Vp/TP]; padded ids -inf. (vLLM shares the base's lm_head the same way.)
    Drafting (no grad) takes the few-row product measured fastest on this machine
    (small_rows_linear.rows_linear): megatron's layer runs MKL's GEMM, which on an Intel Xeon
    took 14 ms for a block's 7 rows of SmolLM2's 49,152-row output layer."""
    base = spec_model.base
    weight = output_weight(spec_model)
    if torch.is_grad_enabled():  # training: megatron's layer and its TP gradient regions
        logits, _ = base.output_layer(hidden, weight=weight)
    else:
        logits = rows_linear(hidden, weight)
    offset = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    padded = torch.arange(offset, offset + logits.shape[-1], device=logits.device) >= spec_model.vocab_size
    return logits.masked_fill(padded, float("-inf")) if bool(padded.any()) else logits

"""Packed rows on the Transformer Engine spec, without TE: TE's layers are declared causal and
ignore an explicit mask, so the training forward hands them megatron's `PackedSeqParams`
(THD, the batch one sequence of b*s tokens) instead of the block-diagonal mask. A stub core
attention stands in for TE's: it records what a TE layer would receive and attends within
each cu_seqlens sequence, so the packed loss must equal the local spec's masked one."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType

from megatron_specdec.data import packed_attention_mask, packed_seq_params

from test_eagle3_unit import _tiny_model


class RecordingTHDAttention(torch.nn.Module):
    """What TE's core attention is given, and causal attention within each THD sequence."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale, self.calls = scale, []

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        self.calls.append(dict(shape=tuple(query.shape), attention_mask=attention_mask,
                               attn_mask_type=attn_mask_type, params=packed_seq_params))
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        out = []
        for a, z in zip(bounds[:-1], bounds[1:]):  # [t, heads, d] per sequence
            q, k, v = (x[a:z].transpose(0, 1) for x in (query, key, value))
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                      enable_gqa=True).transpose(0, 1))
        return torch.cat(out).reshape(query.shape[0], -1)


def _batch():
    g = torch.Generator().manual_seed(4)
    seg = torch.tensor([[1] * 5 + [2] * 6 + [0], [1] * 8 + [2] * 4])
    ids = torch.randint(0, 512, seg.shape, generator=g)
    loss_mask = ((torch.rand(seg.shape, generator=g) > 0.3) & (seg > 0)).long()
    return seg, ids, loss_mask


def test_te_spec_base_takes_packed_seq_params_and_matches_the_masked_loss(one_process):
    model, _, _ = _tiny_model(1)
    seg, ids, loss_mask = _batch()
    b, s = seg.shape
    mask = packed_attention_mask(seg)
    params = [p for p in model.draft.parameters() if p.requires_grad]
    local = model(ids, loss_mask, mask)["loss_sum"]
    local_grads = torch.autograd.grad(local, params)

    stubs = []
    for layer in model.base.decoder.layers:
        stubs.append(RecordingTHDAttention(layer.self_attention.core_attention.softmax_scale))
        layer.self_attention.core_attention = stubs[-1]
    assert model.config.transformer_impl == "local"
    model.config.transformer_impl = "transformer_engine"
    try:
        te = model(ids, loss_mask, mask)["loss_sum"]
        te_grads = torch.autograd.grad(te, params)
        with pytest.raises(ValueError, match="attention_mask"):
            model(ids, loss_mask, mask.transpose(-1, -2).contiguous())  # not causal
    finally:
        model.config.transformer_impl = "local"

    expected = packed_seq_params(seg)
    heads = model.config.num_attention_heads
    for stub in stubs:
        call = stub.calls[0]
        assert call["attention_mask"] is None and call["attn_mask_type"] == AttnMaskType.causal
        assert call["shape"] == (b * s, heads, model.config.kv_channels)
        assert call["params"].qkv_format == "thd"
        assert torch.equal(call["params"].cu_seqlens_q, expected.cu_seqlens_q)
        assert torch.equal(call["params"].cu_seqlens_kv, expected.cu_seqlens_kv)
        assert call["params"].max_seqlen_q == expected.max_seqlen_q == 8
    assert torch.allclose(te, local, rtol=1e-5, atol=1e-5)
    for a, w in zip(te_grads, local_grads):
        assert torch.allclose(a, w, rtol=1e-5, atol=1e-5)


def test_unpacked_rows_keep_the_causal_path_on_te(one_process):
    """No mask: TE's causal attention is the mask, the layers get no packed params."""
    model, _, _ = _tiny_model(1)
    _, ids, loss_mask = _batch()
    model.config.transformer_impl = "transformer_engine"
    try:
        seen = []
        layer = model.base.decoder.layers[0]
        layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
        model(ids, loss_mask)
    finally:
        model.config.transformer_impl = "local"
    assert seen[0]["packed_seq_params"] is None and seen[0]["attention_mask"] is None
    assert tuple(seen[0]["hidden_states"].shape[:2]) == (ids.shape[1], ids.shape[0])

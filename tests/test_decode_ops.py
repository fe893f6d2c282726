"""The decoding layer's C++ ops (csrc/decode_ops.cpp): rms_norm, silu_mul and chain_attention
equal PyTorch's ops within float32 rounding, are bitwise row-invariant (a row or query alone
equals the same one inside a longer call), write the cache where the reference does, and name
bad input in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_specdec.acceptance.ops import op_available

pytestmark = pytest.mark.skipif(not op_available("chain_attention"),
                                reason="megatron_specdec._C is not built with the decoding ops")
ops = torch.ops.megatron_specdec


@pytest.mark.parametrize("hidden", [1, 7, 64, 576, 1003])
def test_rms_norm_equals_torch_and_is_row_invariant(hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(9, 1, hidden, generator=g) * 3
    w = torch.randn(hidden, generator=g)
    got = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (hidden,), w, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(ops.rms_norm(x[4:5], w, 1e-5), got[4:5])
    # A strided view is read as its values.
    wide = torch.randn(9, 1, 2 * hidden, generator=g)[..., ::2]
    torch.testing.assert_close(ops.rms_norm(wide, w, 1e-5),
                               F.rms_norm(wide, (hidden,), w, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("features", [1, 13, 1536])
def test_silu_mul_equals_torch_and_is_row_invariant(features):
    x = torch.randn(6, 2, 2 * features, generator=torch.Generator().manual_seed(features)) * 4
    got = ops.silu_mul(x)
    assert got.shape == (6, 2, features)
    torch.testing.assert_close(got, F.silu(x[..., :features]) * x[..., features:],
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(ops.silu_mul(x[3:4, 1:2]), got[3:4, 1:2])


def reference_chain(qkv, cos, sin, keys, values, first, heads):
    """The op by PyTorch's ops: megatron's QKV split, rotate-half RoPE over the first R
    channels, a causal SDPA over the cache; (output, keys, values)."""
    s = qkv.shape[0]
    groups, dim = keys.shape[2], keys.shape[3]
    per = heads // groups
    mixed = qkv.view(s, 1, groups, (per + 2) * dim)
    q, k, v = torch.split(mixed, [per * dim, dim, dim], dim=3)
    q = q.reshape(s, 1, heads, dim)
    r = cos.shape[-1]

    def rotate(t):
        c, n = cos[:, None, None], sin[:, None, None]
        t1, t2 = t[..., : r // 2], t[..., r // 2: r]
        return torch.cat((t[..., :r] * c + torch.cat((-t2, t1), -1) * n, t[..., r:]), -1)

    keys, values = keys.clone(), values.clone()
    keys[first: first + s], values[first: first + s] = rotate(k), v
    end = first + s
    allowed = torch.arange(end)[None, :] <= (first + torch.arange(s))[:, None]
    out = F.scaled_dot_product_attention(
        rotate(q).permute(1, 2, 0, 3), keys[:end].permute(1, 2, 0, 3),
        values[:end].permute(1, 2, 0, 3), attn_mask=allowed, scale=dim ** -0.5,
        enable_gqa=per > 1)
    return out.permute(2, 0, 1, 3).reshape(s, 1, heads * dim), keys, values


def chain_inputs(s, groups, per, dim, rotary, length, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(s, 1, groups * (per + 2) * dim, generator=g)
    angles = torch.rand(s, rotary // 2, generator=g) * 50
    emb = torch.cat((angles, angles), -1)
    keys = torch.randn(length, 1, groups, dim, generator=g)
    values = torch.randn(length, 1, groups, dim, generator=g)
    return qkv, emb.cos(), emb.sin(), keys, values


@pytest.mark.parametrize("s,groups,per,dim,rotary,first", [
    (1, 3, 3, 64, 64, 0), (5, 3, 3, 64, 64, 20), (16, 2, 1, 32, 16, 7), (3, 1, 4, 12, 12, 90)])
def test_chain_attention_equals_sdpa_and_writes_the_cache(s, groups, per, dim, rotary, first):
    qkv, cos, sin, keys, values = chain_inputs(s, groups, per, dim, rotary, 128, first)
    want, want_keys, want_values = reference_chain(qkv, cos, sin, keys, values, first,
                                                   groups * per)
    got = ops.chain_attention(qkv, cos, sin, keys, values, first, groups * per, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, want_keys, rtol=1e-6, atol=1e-6)
    assert torch.equal(values, want_values)


def test_chain_attention_is_row_invariant_bitwise():
    """Each query of a chain equals the one-token call at its slot over the same cache: a
    verify forward and plain steps see the same attention."""
    qkv, cos, sin, keys, values = chain_inputs(8, 3, 3, 64, 64, 64, 3)
    chain_keys, chain_values = keys.clone(), values.clone()
    chain = ops.chain_attention(qkv, cos, sin, chain_keys, chain_values, 30, 9, 0.125)
    for i in range(8):
        one = ops.chain_attention(qkv[i: i + 1], cos[i: i + 1], sin[i: i + 1], keys, values,
                                  30 + i, 9, 0.125)
        assert torch.equal(one[0], chain[i]), i
    assert torch.equal(keys, chain_keys) and torch.equal(values, chain_values)


@pytest.mark.parametrize("s,groups,per,dim", [(1, 3, 3, 64), (8, 3, 3, 64), (4, 1, 5, 40),
                                          (2, 2, 8, 24)])
def test_chain_attention_same_bits_at_any_thread_count(s, groups, per, dim):
    """Where the attention takes a group's heads together (AVX-512), it takes as many at a
    time as leave every thread work: the grouping changes with the thread count, the bits
    must not."""
    qkv, cos, sin, keys, values = chain_inputs(s, groups, per, dim, dim, 200, 5)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(ops.chain_attention(qkv, cos, sin, keys.clone(), values.clone(), 150,
                                            groups * per, dim ** -0.5))
    finally:
        torch.set_num_threads(threads)
    for n, out in zip((2, 3, 8), outs[1:]):
        assert torch.equal(out, outs[0]), n


def test_the_portable_paths_equal_torch_and_are_row_invariant():
    """Forced by SPECDEC_SKINNY_ISA=scalar in a fresh process (a CPU without AVX2 and FMA), the
    SiLU and the attention take their portable code, which must pass the same checks."""
    code = ("import torch, megatron_specdec._C, test_decode_ops as t\n"
            "assert torch.ops.megatron_specdec.skinny_linear_isa() == 'scalar'\n"
            "for f in (1, 13, 1536): t.test_silu_mul_equals_torch_and_is_row_invariant(f)\n"
            "t.test_chain_attention_equals_sdpa_and_writes_the_cache(5, 3, 3, 64, 64, 20)\n"
            "t.test_chain_attention_equals_sdpa_and_writes_the_cache(3, 1, 4, 12, 12, 90)\n"
            "t.test_chain_attention_is_row_invariant_bitwise()\n"
            "t.test_chain_attention_same_bits_at_any_thread_count(4, 1, 5, 40)\n")
    env = {**os.environ, "SPECDEC_SKINNY_ISA": "scalar",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_chain_attention_bad_input_named_in_one_line():
    qkv, cos, sin, keys, values = chain_inputs(2, 3, 3, 64, 64, 16, 0)
    cases = [
        (dict(first=15), "do not fit a cache of 16"),
        (dict(heads=8), "must be a multiple of the cache's groups"),
        (dict(qkv=qkv[..., :-1]), r"qkv must be \[s, 1, 960\]"),
        (dict(cos=cos[:, :63], sin=sin[:, :63]), "R even"),
        (dict(keys=keys.double()), "must be float32"),
        (dict(keys=keys.transpose(2, 3).contiguous().transpose(2, 3)), "must be contiguous"),
    ]
    for change, message in cases:
        args = dict(qkv=qkv, cos=cos, sin=sin, keys=keys, values=values, first=3, heads=9)
        args.update(change)
        if "keys" in change:
            args["values"] = args["keys"]
        with pytest.raises(RuntimeError, match=message) as info:
            ops.chain_attention(args["qkv"], args["cos"], args["sin"], args["keys"],
                                args["values"], args["first"], args["heads"], 0.125)
        assert "chain_attention" in str(info.value).splitlines()[0]
    with pytest.raises(RuntimeError, match="rms_norm: weight must be float32"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul: the last dim of x must be even"):
        ops.silu_mul(torch.randn(2, 7))


def test_decode_layers_bad_input_named_in_one_line():
    """decode_layers checks its lists and each layer's tensors before any thread starts."""
    h, f, d, groups, per = 64, 96, 16, 2, 2
    g = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    weights = [torch.ones(h), rand(groups * (per + 2) * d, h), None, rand(h, groups * per * d),
               torch.ones(h), rand(2 * f, h), rand(h, f), None]
    keys, values = torch.zeros(8, 1, groups, d), torch.zeros(8, 1, groups, d)
    hidden, cos, sin = rand(2, 1, h), torch.ones(2, d), torch.zeros(2, d)

    def call(**change):
        args = dict(hidden=hidden, weights=weights, eps=[1e-6, 1e-6, 0.0], keys=[keys],
                    values=[values], first=0, heads=[groups * per], blocks=[0, 0, 0, 0],
                    capture=[], embeds=None)
        args.update(change)
        return ops.decode_layers(args["hidden"], args["weights"], args["eps"], cos, sin,
                                 args["keys"], args["values"], args["first"], args["heads"],
                                 [d ** -0.5], args["blocks"], args["capture"], args["embeds"])

    assert call()[0].shape == (2, 1, h)
    cases = [
        (dict(weights=weights[:7]), "weights must hold 8 per layer"),
        (dict(eps=[1e-6, 1e-6]), "eps must hold 3 per layer"),
        (dict(embeds=rand(2, 1, h)), "takes embeds exactly when it has a hidden_norm"),
        (dict(weights=weights[:7] + [torch.ones(h)]), "takes embeds exactly when"),
        (dict(weights=weights[:7] + [torch.ones(h)], embeds=rand(3, 1, h)),
         r"embeds must be float32 \[2, 1, 64\]"),
        (dict(weights=weights[:5] + [rand(2 * f, h).double(), weights[6], None]),
         r"fc1_weight must be float32 \(or a float16 or bfloat16 copy\)"),
        (dict(heads=[4, 4]), "heads and scale must hold one value per layer"),
        (dict(blocks=[0, 0, 0]), "schedules must hold 4 per layer"),
        (dict(blocks=[0, 4, 0, 0]), "decode_layer: schedule must be 0 .*, got 4"),
        (dict(capture=[1]), "capture holds layer 1, expected 0 .. 0"),
        (dict(hidden=rand(2, 2, h)), r"hidden must be float32 \[s, 1, H\]"),
        (dict(weights=weights[:5] + [rand(2 * f + 1, h)] + weights[6:]), "fc1_weight must be"),
        (dict(weights=weights[:3] + [rand(h, 7)] + weights[4:]),
         r"proj_weight must be float32 \(or a float16 or bfloat16 copy\) \[64, 64\]"),
        (dict(weights=[None] + weights[1:]), "input_norm is required"),
        (dict(first=7), "chain_attention: slots 7..8 do not fit a cache of 8"),
    ]
    for change, message in cases:
        with pytest.raises(RuntimeError, match=message) as info:
            call(**change)
        assert str(info.value).splitlines()[0].startswith(("decode_layer", "chain_attention"))

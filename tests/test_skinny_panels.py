"""The skinny op over weights repacked as panels (schedule 3, csrc/skinny_gemm.cpp): bitwise the
op's other schedules for float32, float16 and bfloat16 weights at 1-16 rows and strided inputs,
so a row alone equals the same row among others; a run of decoding layers reading every
product from its panel copy gives bitwise the logits of the rows as stored; bad shapes and a
path without panels named in one line."""

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.acceptance.ops import op_available

pytestmark = pytest.mark.skipif(not op_available("skinny_pack"),
                                reason="megatron_specdec._C is not built with skinny_pack")


def width() -> int:
    return torch.ops.megatron_specdec.skinny_panel_width()


def needs_panels():
    if width() == 0:
        pytest.skip(f"no packed panels on the {torch.ops.megatron_specdec.skinny_linear_isa()} "
                    "path of this CPU (AVX-512 only)")


def skinny(x, w, schedule=0):
    return torch.ops.megatron_specdec.skinny_linear(x, w, schedule)


def pack(w):
    return torch.ops.megatron_specdec.skinny_pack(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("panels,in_features", [(1, 16), (2, 80), (3, 576), (20, 576), (1, 1536)])
def test_panels_are_bitwise_the_rows_as_stored(dtype, panels, in_features):
    needs_panels()
    g = torch.Generator().manual_seed(panels * 100 + in_features)
    w = (torch.randn(panels * width(), in_features, generator=g) * 0.1).to(dtype)
    packed = pack(w)
    assert packed.shape == w.shape and packed.dtype == dtype
    x_all = torch.randn(16, in_features + 3, generator=g)[:, 3:]  # rows strided, not contiguous
    alone = torch.cat([skinny(x_all[i:i + 1], packed, 3) for i in range(16)])
    for rows in range(1, 17):
        x = x_all[:rows]
        got = skinny(x, packed, 3)
        assert torch.equal(got, skinny(x, w, 0)), (rows, (got - skinny(x, w, 0)).abs().max())
        assert torch.equal(got, skinny(x, w, 1))
        assert torch.equal(got, alone[:rows])


def test_packing_refuses_shapes_without_whole_panels():
    needs_panels()
    for shape, message in (((width() + 1, 16), f"N a multiple of {width()}"),
                           ((width(), 20), "K of 16"), ((width(),), "2-D weight")):
        with pytest.raises(RuntimeError, match=message) as info:
            pack(torch.randn(shape))
        assert str(info.value).splitlines()[0].startswith("skinny_pack:")
    with pytest.raises(RuntimeError, match="must be float32, float16 or bfloat16"):
        pack(torch.randn(width(), 16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=f"skinny_linear: packed panels need .* N a multiple"):
        skinny(torch.randn(2, 16), torch.randn(width() - 1, 16), 3)


def test_lower_paths_have_no_panels_and_refuse_them():
    """A path without AVX-512 (forced by SPECDEC_SKINNY_ISA in a fresh process) reports no
    panels and names the path when asked for them."""
    from test_skinny_gemm import on_lower_isa_paths

    needs_panels()
    on_lower_isa_paths(
        "import pytest\n"
        "assert torch.ops.megatron_specdec.skinny_panel_width() == 0\n"
        "with pytest.raises(RuntimeError, match='schedule 3 \\\\(packed panels\\\\) needs the avx512 path'):\n"
        "    torch.ops.megatron_specdec.skinny_linear(torch.randn(2, 48), torch.randn(48, 48), 3)\n")


@pytest.mark.parametrize("bf16_values", [False, True])
def test_a_run_of_layers_reading_panels_gives_the_same_logits_bitwise(bf16_values, monkeypatch):
    """Every product of a batch-1 chain's run read from its panel copy (the 16-bit copy's
    panels for a base of bf16 values): the logits of a prefill, a chain and one-token steps are
    bitwise those of the rows as stored; a choice without panels frees the copies."""
    from test_decode_layer import COMMON, base_model, logits

    from transformers import LlamaConfig

    from megatron_specdec.models import weight_memory
    from megatron_specdec.models.layers import decode_layer, linear_kernels

    needs_panels()
    monkeypatch.setenv(linear_kernels.PIN_ENV, "skinny")
    linear_kernels.reset()
    distributed.initialize(1, 1)
    # Every product's rows whole panels: QKV 2 x 48 + 2 x 48 = 192, output 96, fc1 2 x 192.
    config = LlamaConfig(**{**COMMON, "hidden_size": 2 * width(), "intermediate_size": 4 * width(),
                            "num_attention_heads": 2, "num_key_value_heads": 1})
    base = base_model(config)
    if bf16_values:
        with torch.no_grad():
            for p in base.parameters():
                p.copy_(p.bfloat16().float())

    def products():
        return decode_layer.run_products([w for layer in base.decoder.layers
                                          for w in layer.op_weights[0]])

    try:
        monkeypatch.setenv(linear_kernels.RUN_PIN_ENV, "per_shape")
        rows = logits(base, True, True, batch=1)
        assert all(layer.layer_op for layer in base.decoder.layers)
        assert all(id(w) not in weight_memory._panels for w in products())
        assert {w.dtype for w in products()} == {torch.bfloat16 if bf16_values else torch.float32}
        monkeypatch.setenv(linear_kernels.RUN_PIN_ENV, "skinny_panel")
        panels = logits(base, True, True, batch=1)
        assert all(weight_memory.panel_copy(w) is not None for w in products())
    finally:
        linear_kernels.reset()
    assert torch.equal(panels, rows), (panels - rows).abs().max()


def test_a_run_option_pinned_is_taken_untimed_and_one_not_offered_named(monkeypatch, tmp_path):
    from megatron_specdec.models.layers import linear_kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv(linear_kernels.RUN_PIN_ENV, "skinny_panel")
    options = ("per_shape", "skinny", "skinny_panel")
    untimed = lambda: pytest.fail("timed while pinned")  # noqa: E731
    assert linear_kernels.run_choice("k", 8, options, untimed) == "skinny_panel"
    monkeypatch.setenv(linear_kernels.PIN_ENV, "skinny")  # the run's pin goes first
    assert linear_kernels.run_choice("k", 8, options, untimed) == "skinny_panel"
    with pytest.raises(ValueError, match=r"SPECDEC_RUN='skinny_panel'; this run's options here are "
                                         r"\('per_shape', 'skinny'\)"):
        linear_kernels.run_choice("k", 8, options[:2], untimed)
    assert not (tmp_path / "linear_choice").exists()


def test_the_op_refuses_a_product_without_whole_panels():
    needs_panels()
    ops = torch.ops.megatron_specdec
    h, heads, d = 64, 2, 32  # output product 64 rows: not whole panels of 48
    weights = [torch.ones(h), torch.randn(2 * h, h), None, torch.randn(h, h), torch.ones(h),
               torch.randn(4 * width(), h), torch.randn(h, 2 * width()), None]
    cos, sin = torch.ones(3, d), torch.zeros(3, d)
    keys, values = torch.zeros(8, 1, 1, d), torch.zeros(8, 1, 1, d)
    with pytest.raises(RuntimeError, match=r"decode_layer: proj_weight \[64, 64\] read as packed panels "
                                           r"\(schedule 3\) needs its rows a multiple of 48"):
        ops.decode_layers(torch.randn(3, 1, h), weights, [1e-6, 1e-6, 0.0], cos, sin, [keys], [values],
                          0, [heads], [d ** -0.5], [0, 3, 0, 0], [], None)

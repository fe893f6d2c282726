"""Decoding weights on huge pages (models/weight_memory.py): values, Parameter objects and
views into other buffers are kept; each parameter moves once; the buffer sits at a 2 MiB
boundary; a 16-bit copy only of a weight whose values are all 16-bit values, and a decoding
product over it computes the float32 product's bits."""

import pytest
import torch

from megatron_specdec.models.weight_memory import HUGE_PAGE, huge_page_empty, place_weights


def test_huge_page_empty_is_aligned_and_writable():
    t = huge_page_empty(3 * HUGE_PAGE // 4 + 5)
    assert t.data_ptr() % HUGE_PAGE == 0 and t.numel() == 3 * HUGE_PAGE // 4 + 5
    t.fill_(2.0)
    assert t.sum().item() == 2.0 * t.numel()
    assert huge_page_empty(0).numel() == 0


def test_place_weights_keeps_values_and_parameters_and_moves_each_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8, bias=False))
    shared = torch.nn.Parameter(torch.randn(4, 64))  # a view into another buffer: left alone
    model.register_parameter("shared", shared)
    big = torch.randn(8, 64)
    model.shared.data = big[:4]
    params = list(model.parameters())
    own = [p for p in params if p is not model.shared]
    before = [p.detach().clone() for p in params]
    x = torch.randn(3, 64)
    want = model(x)
    place_weights(model)
    assert list(model.parameters()) == params
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert model.shared.data_ptr() == big.data_ptr()
    moved = {p.data_ptr() for p in own}
    storage = own[0].untyped_storage().data_ptr()
    assert storage % HUGE_PAGE == 0
    assert all(p.untyped_storage().data_ptr() == storage for p in own)
    assert torch.equal(model(x), want)
    place_weights(model)  # again: nothing moves
    assert {p.data_ptr() for p in own} == moved


def test_narrow_copy_only_of_exact_values_and_rebuilt_when_they_change():
    from megatron_specdec.models.weight_memory import narrow_copy

    g = torch.Generator().manual_seed(0)
    bf16 = torch.randn(12, 40, generator=g).bfloat16().float()
    copy = narrow_copy(bf16)
    assert copy.dtype == torch.bfloat16 and torch.equal(copy.float(), bf16)
    assert copy.data_ptr() % HUGE_PAGE == 0 and narrow_copy(bf16) is copy  # built once
    half = (torch.randn(12, 40, generator=g) * 0.1).half().float()  # finer than bfloat16
    assert narrow_copy(half).dtype == torch.float16 and torch.equal(narrow_copy(half).float(), half)
    assert narrow_copy(torch.randn(12, 40, generator=g)) is None  # float32 values
    assert narrow_copy(bf16.double()) is None and narrow_copy(bf16[0]) is None
    bf16[3, 5] = 1.0 + 2.0 ** -20  # no longer bfloat16 (or float16) values: no copy
    assert narrow_copy(bf16) is None
    bf16[3, 5] = 0.5
    assert torch.equal(narrow_copy(bf16).float(), bf16)


def test_no_narrow_copy_past_the_first_values_or_the_memory(monkeypatch, caplog):
    """A weight whose first 4096 values are bf16 values but not a later one gets no copy; nor
    does one whose copy would take more than half the memory left (warned once)."""
    from megatron_specdec.models import weight_memory

    late = torch.randn(64, 128).bfloat16().float()
    late[63, 127] = 1.0 + 2.0 ** -20
    assert weight_memory.narrow_copy(late) is None
    monkeypatch.setattr(weight_memory, "available_bytes", lambda: 3 * 64 * 128)
    monkeypatch.setattr(weight_memory, "_warned_memory", set())
    tight = torch.randn(64, 128).bfloat16().float()
    with caplog.at_level("WARNING", logger=weight_memory.__name__):
        assert weight_memory.narrow_copy(tight) is None
        assert weight_memory.narrow_copy(torch.randn(8, 8).bfloat16().float()) is not None
        assert weight_memory.narrow_copy(tight.clone()) is None
    assert [r.getMessage() for r in caplog.records] == [
        "no 16-bit copy of a [64, 128] weight (0 MB, 0 MB of memory available): such weights "
        "are read in float32"]


def test_decoding_linear_over_a_narrow_copy_equals_its_float32_product(monkeypatch):
    from megatron_specdec.acceptance.ops import op_available
    from megatron_specdec.models.layers import linear_kernels
    from megatron_specdec.models.layers.small_rows_linear import rows_linear
    from megatron_specdec.models.weight_memory import narrow_copy

    if not op_available("skinny_linear"):
        pytest.skip("megatron_specdec._C is not built with skinny_linear")
    monkeypatch.setenv(linear_kernels.PIN_ENV, "skinny")
    linear_kernels.reset()
    try:
        w = torch.randn(70, 96).bfloat16().float()
        x = torch.randn(3, 96)
        with torch.no_grad():
            assert torch.equal(rows_linear(x, w), linear_kernels.skinny(x, w))
        assert narrow_copy(w) is not None  # the product above read it
    finally:
        linear_kernels.reset()

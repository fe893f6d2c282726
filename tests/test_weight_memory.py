"""Decoding weights on huge pages (models/weight_memory.py): values, Parameter objects and
views into other buffers are kept; each parameter moves once; the buffer sits at a 2 MiB
boundary."""

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

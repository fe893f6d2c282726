"""The skinny GEMM of decoding (csrc/skinny_gemm.cpp): equal to F.linear within fp32 tolerance
for random shapes, 1-16 rows and strided inputs, at every schedule; bitwise row-invariant (a
row alone equals the same row inside a call of 2, 5, 8, 16 or more rows, whichever schedule
each call takes) on every ISA path this CPU runs; a float16 or bfloat16 weight computes bitwise
what its float32 copy does; bad input named in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_specdec.acceptance.ops import op_available

pytestmark = pytest.mark.skipif(not op_available("skinny_linear"),
                                reason="megatron_specdec._C is not built with skinny_linear")


# The op's schedules (skinny_gemm.h): the ISA's block with the next block's lines spread over
# each pass, one weight row a block, the ISA's block with them in a burst.
SCHEDULES = (0, 1, 2)


def skinny(x, w, schedule=0):
    return torch.ops.megatron_specdec.skinny_linear(x, w, schedule)


# In-features off the vector width (tails of 1..15), out-features off the 4-row block.
SHAPES = [(1, 1), (3, 7), (37, 64), (80, 100), (131, 576), (9, 1000), (576, 1536)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_equals_f_linear(out_features, in_features):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    for rows in range(1, 17):
        x = torch.randn(rows, in_features, generator=g)
        for schedule in SCHEDULES:
            out = skinny(x, w, schedule)
            assert out.shape == (rows, out_features) and out.is_contiguous()
            torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5,
                                       atol=1e-5 * in_features ** 0.5)


def test_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(0)
    w_big = torch.randn(70, 200, generator=g)
    w = w_big[3:68, 5:133]  # rows strided, in-features contiguous
    wt = torch.randn(128, 65, generator=g).t()  # in-features strided: copied
    x_big = torch.randn(6, 3, 300, generator=g)
    views = {
        "sliced last dim": x_big[:, :, 10:138],
        "transposed batch": x_big.transpose(0, 1)[:, :, :128],
        "step over rows": x_big[::2, :, 50:178],
        "in-features strided": torch.randn(2, 128 * 3, generator=g)[:, ::3],
        "one row, 3-D": x_big[:1, :1, :128],
    }
    for name, x in views.items():
        assert not x.is_contiguous() or name == "one row, 3-D"
        for weight, schedule in ((w, 0), (wt, 0), (w, 1), (w, 2)):
            out = skinny(x, weight, schedule)
            assert out.shape == x.shape[:-1] + (weight.shape[0],), name
            torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4, msg=name)


def _invariance(in_features: int):
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(203, in_features, generator=g)
    x = torch.randn(40, in_features, generator=g)
    alone = torch.cat([skinny(x[i: i + 1], w, 1) for i in range(x.shape[0])])
    assert torch.equal(torch.cat([skinny(x[i: i + 1], w) for i in range(x.shape[0])]), alone)
    for m in (2, 5, 8, 16, 33, 40):
        for start in (0, x.shape[0] - m):  # a row at every place of the call
            for schedule in SCHEDULES:
                together = skinny(x[start: start + m], w, schedule)
                assert torch.equal(together, alone[start: start + m]), (in_features, m, start)


@pytest.mark.parametrize("in_features", [576, 1000, 13])
def test_row_invariant_bitwise(in_features):
    _invariance(in_features)


def _narrow_weights():
    """A 16-bit weight computes bitwise what its float32 copy computes, at every row count,
    schedule and tail length."""
    g = torch.Generator().manual_seed(16)
    for dtype in (torch.float16, torch.bfloat16):
        for out_features, in_features in [(37, 64), (131, 576), (9, 1000), (5, 7), (3, 1)]:
            narrow = (torch.randn(out_features, in_features, generator=g) * 0.1).to(dtype)
            for rows in (1, 2, 5, 8, 16):
                x = torch.randn(rows, in_features, generator=g)
                for schedule in SCHEDULES:
                    assert torch.equal(skinny(x, narrow, schedule), skinny(x, narrow.float())), \
                        (dtype, out_features, in_features, rows, schedule)


def test_narrow_weights_bitwise_their_float32_copy():
    _narrow_weights()


def on_lower_isa_paths(body: str):
    """Run `body` (Python, with `torch` and `megatron_specdec._C` imported) in a fresh process
    on each ISA path below the one this CPU takes (forced by SPECDEC_SKINNY_ISA), the tests
    directory importable; each run must exit cleanly."""
    best = torch.ops.megatron_specdec.skinny_linear_isa()
    paths = ["avx512", "avx2", "scalar"]
    for isa in paths[paths.index(best) + 1:]:
        code = ("import torch, megatron_specdec._C\n"
                f"assert torch.ops.megatron_specdec.skinny_linear_isa() == '{isa}'\n" + body)
        env = {**os.environ, "SPECDEC_SKINNY_ISA": isa,
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                              os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run([sys.executable, "-c", code], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (isa, run.stderr[-2000:])


def test_row_invariant_on_every_isa_path():
    """The lower ISA paths (forced by SPECDEC_SKINNY_ISA in a fresh process) are as correct
    and as row-invariant as the one this CPU takes."""
    on_lower_isa_paths(
        "import torch.nn.functional as F, test_skinny_gemm as t\n"
        "for k in (576, 13): t._invariance(k)\n"
        "t._narrow_weights()\n"
        "w, x = torch.randn(37, 100), torch.randn(7, 100)\n"
        "torch.testing.assert_close(t.skinny(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)\n")


def test_bad_input_named_in_one_line():
    w = torch.randn(8, 16)
    cases = [
        (torch.randn(2, 16, dtype=torch.float64), w, "must be float32"),
        (torch.randn(2, 16), w.double(), "must be float32"),
        (torch.randn(2, 16).bfloat16(), w.bfloat16(), "must be float32"),
        (torch.randn(2, 15), w, r"x must be \[\.\.\., 16\]"),
        (torch.randn(2, 16), torch.randn(8, 16, 1), "weight must be 2-D"),
    ]
    for x, weight, message in cases:
        with pytest.raises(RuntimeError, match=message) as info:
            skinny(x, weight)
        assert "skinny_linear" in str(info.value).splitlines()[0]
    with pytest.raises(RuntimeError, match=r"schedule must be 0 \(the ISA's block, .*, got 4"):
        skinny(torch.randn(2, 16), w, 4)


def test_empty_shapes():
    assert skinny(torch.randn(0, 16), torch.randn(8, 16)).shape == (0, 8)
    assert torch.equal(skinny(torch.randn(3, 0), torch.randn(8, 0)), torch.zeros(3, 8))

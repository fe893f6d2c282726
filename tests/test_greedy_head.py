"""The screened greedy head (csrc/greedy_head.cpp, models/layers/greedy_head.py): the argmax
id of every row, and its logit, bitwise those of the skinny GEMM's float32 logits and
torch.argmax, on near-ties, exact ties (lowest id), NaN, zero and huge inputs, weights of any
range and rows that are not finite, on every ISA path; the bound is what keeps the maximum
(without it near-ties go wrong); a decoding stage's greedy ids equal the argmax of its logits;
bad input named."""

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.acceptance.ops import op_available

pytestmark = pytest.mark.skipif(not op_available("greedy_head"),
                                reason="megatron_specdec._C is not built with greedy_head")


def logits(x, w):
    return torch.ops.megatron_specdec.skinny_linear(x, w)


def close_rows(seed: int, n: int = 3000, k: int = 200):
    """A weight of n rows in clusters of near-duplicates (rows far closer than an int8
    rounding), so the top logits of a row of x often sit closer than the screen's error."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n // 10, k, generator=g) * 0.05
    w = centres.repeat_interleave(10, dim=0)
    return (w + torch.randn(n, k, generator=g) * 1e-5).contiguous()


def _check_head(seed: int = 0):
    from megatron_specdec.models.layers.greedy_head import GreedyHead

    w = close_rows(seed)
    head = GreedyHead(w, w.shape[0])
    g = torch.Generator().manual_seed(seed + 1)
    for rows in list(range(1, 17)) + [40]:
        # Rows of x along a weight row (the top logits then come from its cluster) and random.
        x = torch.cat([w[torch.randint(0, w.shape[0], (rows // 2,), generator=g)] * 40,
                       torch.randn(rows - rows // 2, w.shape[1], generator=g)])
        full = logits(x, w)
        ids, values = head(x)
        assert torch.equal(ids, full.argmax(-1)), rows
        assert torch.equal(values, full.gather(1, ids[:, None])[:, 0]), rows


def test_greedy_head_equals_the_argmax_of_the_float32_logits():
    _check_head()


def _check_screened(seed: int = 0):
    """With `screened` the op also gives every screened logit, each within its bound of the
    float32 logit; the ids and logits are those of the plain call, bitwise."""
    from megatron_specdec.models.layers.greedy_head import GreedyHead

    w = close_rows(seed)
    head = GreedyHead(w, w.shape[0])
    g = torch.Generator().manual_seed(seed + 2)
    k = w.shape[1]
    qmax = min(32767, (2 ** 31 - 1) // (127 * k))
    for rows in (1, 3, 7, 16):
        x = torch.randn(rows, k, generator=g) * 3
        ids, values, z = head(x, screened=True)
        assert all(torch.equal(a, b) for a, b in zip((ids, values), head(x)))
        full = logits(x, w)
        t = x.abs().amax(1, keepdim=True) / qmax
        e = (x.double() - t.double() * (x / t).round().clamp(-qmax, qmax).double()).norm(dim=1)
        bound = head.bound[0] * x.norm(dim=1)[:, None] + head.bound[1] * e.float()[:, None]
        assert z.shape == full.shape and bool(((z - full).abs() <= bound * 1.01).all())
        assert bool(((z - full).abs() > 0).any())  # screened, not the float32 logits


def test_screened_logits_lie_within_their_bounds():
    _check_screened()


def test_greedy_head_on_every_isa_path():
    """The lower ISA paths (forced in a fresh process) screen as exactly."""
    from test_skinny_gemm import on_lower_isa_paths

    on_lower_isa_paths("import test_greedy_head as t\nt._check_head(3)\nt._check_screened(4)\n")


def test_the_bound_is_what_keeps_the_maximum():
    """With every bound zero (the screened logits trusted as they are) near-ties pick other
    ids than the float32 argmax: the checks above can fail."""
    from megatron_specdec.models.layers.greedy_head import GreedyHead

    w = close_rows(7)
    head = GreedyHead(w, w.shape[0])
    x = w[::10][:200] * 40
    want = logits(x, w).argmax(-1)
    assert torch.equal(head(x)[0], want)
    head.bound = torch.zeros_like(head.bound)
    assert not torch.equal(head(x)[0], want)


def test_ties_nan_zero_and_rows_of_any_range():
    from megatron_specdec.models.layers.greedy_head import GreedyHead

    w = close_rows(11, n=500)
    w[120, 0] = w[300, 0] = 1.0  # an exact tie on x = e_0: the lowest id wins
    w[450, 1] = 1e6  # a row of its own range: its own scale
    w[451] *= 1e-30
    eye = torch.eye(w.shape[1])
    x = torch.stack([eye[0], -w[50], torch.full_like(w[0], float("nan")), eye[1],
                     torch.zeros_like(w[0]), w[451] * 1e30, w[7] * 1e30])
    full = logits(x, w)
    ids, values = GreedyHead(w, w.shape[0])(x)
    assert torch.equal(ids, full.argmax(-1)) and ids[0] == 120 and ids[3] == 450
    finite = [0, 1, 3, 4, 5, 6]
    assert torch.equal(values[finite], full.gather(1, ids[:, None])[finite, 0])
    assert ids[2] == 0 and values[2].isnan()
    # A row that is not finite is computed in float32: it wins where its logit is +inf or
    # NaN, and loses where it is -inf.
    w[460, 2] = float("inf")
    x = torch.stack([eye[2], -eye[2], eye[3], x[1]])
    full = logits(x, w)
    ids, values = GreedyHead(w, w.shape[0])(x)
    assert torch.equal(ids, full.argmax(-1)) and ids[0] == 460 and ids[1] != 460
    assert torch.equal(values[:2], full.gather(1, ids[:, None])[:2, 0])


def test_padding_only_slice_offers_nothing():
    from megatron_specdec.models.layers.greedy_head import GreedyHead

    ids, values = GreedyHead(torch.randn(8, 16), 0)(torch.randn(3, 16))
    assert ids.tolist() == [0, 0, 0] and values.eq(float("-inf")).all()


def test_bad_input_named_in_one_line():
    op = torch.ops.megatron_specdec.greedy_head
    w = torch.randn(8, 16)
    s, b = torch.ones(8), torch.ones(2, 8)
    q = w.to(torch.int8)
    cases = [
        ((torch.randn(2, 16).double(), q, s, w, b), "x must be float32"),
        ((torch.randn(2, 16), w.half(), s, w, b), "screen must be contiguous int8"),
        ((torch.randn(2, 16), q, s[:7], w, b), "scale must be"),
        ((torch.randn(2, 16), q, s, w[:4], b), "weight must be float32"),
        ((torch.randn(2, 16), q, s, w, torch.ones(8)), "bound must be"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message) as info:
            op(*args)
        assert "greedy_head" in str(info.value).splitlines()[0]


def test_ids_and_confidences_over_tensor_parallel_ranks(tmp_path):
    """At TP=2 (one all_gather of ids, logits and log-sum-exps) the ids are the argmax of the
    whole vocabulary's float32 logits, padding rows never win, and the probabilities are the
    one-rank head's (the same screened logits, their log-sum-exps combined over ranks)."""
    from megatron_specdec.models.layers.greedy_head import GreedyHead
    import workers

    vocab = 2990  # 3000 rows: rank 1 holds 1490 of the vocabulary and 10 padding rows
    w = close_rows(3, n=3000)
    w[vocab:] = w[:10] * 50  # padding that would win if it were read
    g = torch.Generator().manual_seed(4)
    # Rows along weight rows on both sides of the split (near-ties inside a cluster), random.
    x = torch.cat([w[[5, 1495, 1505, 2900]] * 40, torch.randn(3, w.shape[1], generator=g)])
    out = tmp_path / "out.pt"
    distributed.spawn(workers.greedy_head_tp, 2, vocab, w, x, str(out))
    got = torch.load(out)
    full = logits(x, w[:vocab])
    assert torch.equal(got["ids"], full.argmax(-1))
    assert torch.equal(got["confident_ids"], full.argmax(-1))
    ids, values, screened = GreedyHead(w, vocab)(x, screened=True)
    one_rank = (values.double() - screened.logsumexp(-1).double()).exp()
    torch.testing.assert_close(got["p"], one_rank, rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def model():
    from test_speculative_generation import build

    distributed.initialize(1, 1)
    return build("eagle3")


def test_stage_greedy_ids_equal_the_argmax_of_its_logits(model):
    """StageRunner.step(greedy=True) through the screened head (checked to be taken) gives the
    ids of step()'s logits, at 1-8 tokens a forward."""
    from megatron_specdec.inference.generation import StageRunner
    from megatron_specdec.models.layers import greedy_head
    from test_speculative_generation import HF

    vocab = HF["vocab_size"]
    weight = (model.base.shared_embedding_or_output_weight()
              if model.base.share_embeddings_and_output_weights
              else model.base.output_layer.weight)
    tokens = torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(5))
    by_ids, by_logits = (StageRunner(model.base, 1, 40, vocab) for _ in range(2))
    by_ids.step(tokens[:, :20], greedy=True)
    by_logits.step(tokens[:, :20])
    at = 20
    for width in (1, 2, 4, 8, 1, 3):
        if "skinny" in greedy_head.product(weight, width).__name__:
            assert greedy_head.greedy_head(weight, vocab, width) is not None
        ids = by_ids.step(tokens[:, at: at + width], greedy=True)
        want = by_logits.step(tokens[:, at: at + width]).argmax(-1)
        assert ids.dtype == torch.long and torch.equal(ids, want), width
        at += width

"""The fused C++ acceptance ops return exactly what the PyTorch reference returns."""
import pytest
import torch

import megatron_specdec._C  # noqa: F401  (the extension must be built: setup.py always builds it)
from megatron_specdec.acceptance import reference

OPS = torch.ops.megatron_specdec
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def assert_same(fused, ref):
    assert len(fused) == len(ref)
    for a, b in zip(fused, ref):
        assert a.dtype == torch.long and a.shape == b.shape
        assert torch.equal(a, b), f"fused\n{a}\nreference\n{b}"


def chain_case(gen, batch, k, vocab, dtype=torch.float32, accept_bias=3.0, scale=2.0):
    """Random chain inputs where drafts often (not always) agree with the target."""
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * scale
    draft = torch.randint(0, vocab, (batch, k), generator=gen)
    hit = torch.rand(batch, k, generator=gen) < 0.7
    draft = torch.where(hit, logits[:, :k].argmax(-1), draft)
    logits[:, :k].scatter_add_(2, draft[..., None], torch.full((batch, k, 1), accept_bias))
    lens = torch.randint(0, k + 1, (batch,), generator=gen)
    q = (logits[:, :k] + torch.randn(batch, k, vocab, generator=gen)).softmax(-1)
    u = torch.rand(batch, k + 1, generator=gen)
    return draft, logits.to(dtype), lens, q, u


def random_tree(gen, batch, n):
    parents = torch.empty(batch, n, dtype=torch.long)
    for i in range(n):
        parents[:, i] = torch.randint(-1, i, (batch,), generator=gen)
    return parents


def tree_case(gen, batch, n, vocab, dtype=torch.float32):
    parents = random_tree(gen, batch, n)
    logits = torch.randn(batch, n + 1, vocab, generator=gen) * 2.0
    ids = torch.randint(0, vocab, (batch, n), generator=gen)
    for i in range(n):  # make ~60% of nodes the target argmax after their parent
        top = logits.gather(1, (parents[:, i] + 1)[:, None, None].expand(batch, 1, vocab)).squeeze(1).argmax(-1)
        ids[:, i] = torch.where(torch.rand(batch, generator=gen) < 0.6, top, ids[:, i])
    nodes = torch.randint(0, n + 1, (batch,), generator=gen)
    q = torch.randn(batch, n, vocab, generator=gen).softmax(-1)
    u = torch.rand(batch, n + 1, generator=gen)
    depth = int(reference.tree_depths(parents, nodes).max()) if n else 0
    return ids, parents, logits.to(dtype), nodes, q, u, depth


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_chain_random(dtype):
    gen = torch.Generator().manual_seed(1)
    draft, logits, lens, _, _ = chain_case(gen, 64, 7, 300, dtype)
    assert_same(OPS.greedy_chain_verify(draft, logits, lens), reference.greedy_chain_verify(draft, logits, lens))
    ids = logits.argmax(-1)
    assert_same(OPS.greedy_chain_verify_ids(draft, ids, lens), reference.greedy_chain_verify_ids(draft, ids, lens))


def test_greedy_chain_edges():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=gen)
    target = logits.argmax(-1)
    all_ok = target[:, :4].clone()
    first_bad = all_ok.clone()
    first_bad[:, 0] = (first_bad[:, 0] + 1) % 11
    for draft, lens, counts in [
        (all_ok, torch.tensor([4, 4, 4]), [4, 4, 4]),  # all accepted: bonus token at index 4
        (first_bad, torch.tensor([4, 4, 4]), [0, 0, 0]),
        (all_ok, torch.tensor([0, 2, 4]), [0, 2, 4]),  # mixed lengths cap acceptance
    ]:
        tokens, got = OPS.greedy_chain_verify(draft, logits, lens)
        assert got.tolist() == counts
        for b, c in enumerate(counts):
            assert tokens[b, : c + 1].tolist() == target[b, : c + 1].tolist()
            assert (tokens[b, c + 1 :] == -1).all()
        assert_same((tokens, got), reference.greedy_chain_verify(draft, logits, lens))
    # K = 0: only the target token.
    empty = torch.zeros(3, 0, dtype=torch.long)
    tokens, got = OPS.greedy_chain_verify(empty, logits[:, :1], torch.zeros(3, dtype=torch.long))
    assert tokens[:, 0].tolist() == target[:, 0].tolist() and got.tolist() == [0, 0, 0]
    # Vocab 1: everything matches.
    tokens, got = OPS.greedy_chain_verify(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 1),
                                          torch.tensor([3, 1]))
    assert tokens.tolist() == [[0, 0, 0, 0], [0, 0, -1, -1]] and got.tolist() == [3, 1]


def test_greedy_ties_take_first_index():
    logits = torch.zeros(1, 2, 5)
    logits[0, 0, [1, 3]] = 2.0
    for draft, count in [([1], 1), ([3], 0)]:
        d = torch.tensor([draft])
        assert_same(OPS.greedy_chain_verify(d, logits, torch.tensor([1])),
                    reference.greedy_chain_verify(d, logits, torch.tensor([1])))
        assert OPS.greedy_chain_verify(d, logits, torch.tensor([1]))[1].item() == count


SAMPLING = [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 5, 1.0), (1.0, 0, 0.7), (0.8, 20, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
@pytest.mark.parametrize("with_q", [False, True])
def test_stochastic_chain_random(temperature, top_k, top_p, with_q):
    gen = torch.Generator().manual_seed(3)
    draft, logits, lens, q, u = chain_case(gen, 96, 6, 257)
    q = q if with_q else None
    args = (draft, logits, lens, q, u, temperature, top_k, top_p)
    out = OPS.stochastic_chain_verify(*args)
    assert_same(out, reference.stochastic_chain_verify(*args))
    assert 0 < out[1].sum() < lens.sum()  # the case exercises both acceptance and rejection


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_stochastic_chain_dtypes(dtype, q_dtype):
    gen = torch.Generator().manual_seed(4)
    draft, logits, lens, q, u = chain_case(gen, 32, 5, 129, dtype)
    args = (draft, logits, lens, q.to(q_dtype), u, 0.9, 0, 1.0)
    assert_same(OPS.stochastic_chain_verify(*args), reference.stochastic_chain_verify(*args))


def test_stochastic_chain_edges():
    gen = torch.Generator().manual_seed(5)
    draft, logits, _, q, u = chain_case(gen, 8, 4, 50)
    full = torch.full((8,), 4)
    # u = 0 accepts every draft with p > 0; u close to 1 with a disfavoured draft rejects the first.
    for uniforms, lens in [(torch.zeros(8, 5), full), (u, torch.tensor([0, 1, 2, 3, 4, 0, 4, 2]))]:
        for probs in (None, q):
            args = (draft, logits, lens, probs, uniforms, 1.0, 0, 1.0)
            out = OPS.stochastic_chain_verify(*args)
            assert_same(out, reference.stochastic_chain_verify(*args))
    tokens, counts = OPS.stochastic_chain_verify(draft, logits, full, None, torch.zeros(8, 5), 1.0, 0, 1.0)
    assert counts.tolist() == [4] * 8 and torch.equal(tokens[:, :4], draft)
    bad = logits.clone()
    bad[:, :4].scatter_(2, draft[..., None], -30.0)
    ones = torch.full((8, 5), 0.999)
    tokens, counts = OPS.stochastic_chain_verify(draft, bad, full, None, ones, 1.0, 0, 1.0)
    assert counts.tolist() == [0] * 8 and (tokens[:, 0] != draft[:, 0]).all() and (tokens[:, 1:] == -1).all()
    assert_same((tokens, counts), reference.stochastic_chain_verify(draft, bad, full, None, ones, 1.0, 0, 1.0))
    # K = 0 samples the bonus token from p at row 0; vocab 1 accepts everything.
    empty = torch.zeros(8, 0, dtype=torch.long)
    args = (empty, logits[:, :1], torch.zeros(8, dtype=torch.long), None, u[:, :1], 1.0, 0, 1.0)
    assert_same(OPS.stochastic_chain_verify(*args), reference.stochastic_chain_verify(*args))
    tokens, counts = OPS.stochastic_chain_verify(torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 4, 1),
                                                 torch.tensor([3, 2]), None, torch.rand(2, 4), 1.0, 0, 1.0)
    assert tokens.tolist() == [[0, 0, 0, 0], [0, 0, 0, -1]] and counts.tolist() == [3, 2]


def test_stochastic_chain_large_vocab():
    gen = torch.Generator().manual_seed(6)
    draft, logits, lens, q, u = chain_case(gen, 4, 4, 49152, torch.bfloat16, accept_bias=12.0, scale=3.0)
    for probs, params in [(q, (1.0, 0, 1.0)), (None, (0.7, 50, 0.95))]:
        args = (draft, logits, lens, probs, u, *params)
        assert_same(OPS.stochastic_chain_verify(*args), reference.stochastic_chain_verify(*args))
    assert_same(OPS.greedy_chain_verify(draft, logits, lens), reference.greedy_chain_verify(draft, logits, lens))


@pytest.mark.parametrize("seed", range(12))
def test_chain_property_random_shapes(seed):
    """Hypothesis-style: random shapes, lengths, dtypes and sampling settings, fixed seeds."""
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda hi: int(torch.randint(0, hi, (1,), generator=gen))  # noqa: E731
    batch, k, vocab = 1 + pick(20), pick(9), 1 + pick(400)
    dtype = DTYPES[pick(4)]
    draft, logits, lens, q, u = chain_case(gen, batch, k, vocab, dtype, accept_bias=float(pick(6)))
    temperature = [0.3, 1.0, 2.5][pick(3)]
    top_k, top_p = [0, 1, 3, vocab][pick(4)], [1.0, 0.5, 0.95][pick(3)]
    assert_same(OPS.greedy_chain_verify(draft, logits, lens), reference.greedy_chain_verify(draft, logits, lens))
    for probs in (None, q):
        args = (draft, logits, lens, probs, u, temperature, top_k, top_p)
        assert_same(OPS.stochastic_chain_verify(*args), reference.stochastic_chain_verify(*args))
    args = (draft, logits, lens, temperature, 0.09, 0.3)
    assert_same(OPS.typical_verify(*args), reference.typical_verify(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_greedy_random(dtype):
    gen = torch.Generator().manual_seed(7)
    ids, parents, logits, nodes, _, _, depth = tree_case(gen, 64, 20, 7, dtype)
    out = OPS.tree_verify_greedy(ids, parents, logits, nodes, depth)
    assert_same(out, reference.tree_verify_greedy(ids, parents, logits, nodes, depth))
    assert out[1].max() >= 2


def test_tree_greedy_structure():
    # root -> 0, 1; 0 -> 2; 1 -> 3 -> 4. The target accepts nodes 1, 3, not 4, then emits argmax row 4.
    logits = torch.full((1, 6, 8), -5.0)
    for row, tok in [(0, 1), (2, 4), (4, 2), (5, 7)]:  # row r follows node r-1
        logits[0, row, tok] = 5.0
    ids = torch.tensor([[0, 1, 3, 4, 6]])
    parents = torch.tensor([[-1, -1, 0, 1, 3]])
    tokens, counts, path = OPS.tree_verify_greedy(ids, parents, logits, torch.tensor([5]), 3)
    assert counts.tolist() == [2] and path.tolist() == [[1, 3, -1]] and tokens.tolist() == [[1, 4, 2, -1]]
    assert_same((tokens, counts, path), reference.tree_verify_greedy(ids, parents, logits, torch.tensor([5]), 3))


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING[:3])
@pytest.mark.parametrize("with_q", [False, True])
def test_tree_stochastic_random(temperature, top_k, top_p, with_q):
    gen = torch.Generator().manual_seed(8)
    ids, parents, logits, nodes, q, u, depth = tree_case(gen, 48, 16, 9)
    args = (ids, parents, logits, nodes, q if with_q else None, u, depth, temperature, top_k, top_p)
    out = OPS.tree_verify_stochastic(*args)
    assert_same(out, reference.tree_verify_stochastic(*args))
    assert out[1].max() >= 1


def test_tree_edges():
    gen = torch.Generator().manual_seed(9)
    # N = 0: only the target token after the root.
    empty = torch.zeros(3, 0, dtype=torch.long)
    logits = torch.randn(3, 1, 10, generator=gen)
    zero = torch.zeros(3, dtype=torch.long)
    assert_same(OPS.tree_verify_greedy(empty, empty, logits, zero, 0),
                reference.tree_verify_greedy(empty, empty, logits, zero, 0))
    u = torch.rand(3, 1, generator=gen)
    assert_same(OPS.tree_verify_stochastic(empty, empty, logits, zero, None, u, 0, 1.0, 0, 1.0),
                reference.tree_verify_stochastic(empty, empty, logits, zero, None, u, 0, 1.0, 0, 1.0))
    # A pure chain as a tree with u = 0 accepts every node; duplicate siblings are handled.
    ids, parents, logits, nodes, q, u, depth = tree_case(gen, 6, 8, 1)  # vocab 1: all nodes are token 0
    for probs in (None, q):
        args = (ids, parents, logits, nodes, probs, torch.zeros_like(u), depth, 1.0, 0, 1.0)
        out = OPS.tree_verify_stochastic(*args)
        assert_same(out, reference.tree_verify_stochastic(*args))
    assert_same(OPS.tree_verify_greedy(ids, parents, logits, nodes, depth),
                reference.tree_verify_greedy(ids, parents, logits, nodes, depth))


def test_tree_large_vocab():
    gen = torch.Generator().manual_seed(10)
    ids, parents, logits, nodes, _, u, depth = tree_case(gen, 3, 10, 49152, torch.bfloat16)
    assert_same(OPS.tree_verify_greedy(ids, parents, logits, nodes, depth),
                reference.tree_verify_greedy(ids, parents, logits, nodes, depth))
    args = (ids, parents, logits, nodes, None, u, depth, 1.0, 0, 1.0)
    assert_same(OPS.tree_verify_stochastic(*args), reference.tree_verify_stochastic(*args))


@pytest.mark.parametrize("seed", range(8))
def test_tree_property_random_shapes(seed):
    gen = torch.Generator().manual_seed(200 + seed)
    pick = lambda hi: int(torch.randint(0, hi, (1,), generator=gen))  # noqa: E731
    ids, parents, logits, nodes, q, u, depth = tree_case(gen, 1 + pick(12), pick(25), 1 + pick(30), DTYPES[pick(4)])
    max_depth = depth + pick(2) if depth < ids.shape[1] else depth
    assert_same(OPS.tree_verify_greedy(ids, parents, logits, nodes, max_depth),
                reference.tree_verify_greedy(ids, parents, logits, nodes, max_depth))
    for probs in (None, q):
        args = (ids, parents, logits, nodes, probs, u, max_depth, [0.5, 1.0, 2.0][pick(3)], pick(4), 1.0)
        assert_same(OPS.tree_verify_stochastic(*args), reference.tree_verify_stochastic(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_typical_random(dtype):
    gen = torch.Generator().manual_seed(11)
    draft, logits, lens, _, _ = chain_case(gen, 64, 6, 200, dtype, accept_bias=2.0)
    for temperature, eps, alpha in [(1.0, 0.09, 0.3), (0.5, 0.2, 0.5), (2.0, 0.05, 0.1)]:
        args = (draft, logits, lens, temperature, eps, alpha)
        out = OPS.typical_verify(*args)
        assert_same(out, reference.typical_verify(*args))
        assert 0 < out[1].sum() < lens.sum()


def test_typical_semantics_and_edges():
    # Row 0 is uniform over 4 tokens: H = log 4, threshold = min(0.09, 0.3/4) = 0.075 < 0.25: accepted.
    # Row 1 is peaked on token 2 (p ~ 1): draft 3 has p ~ 0 and is rejected; argmax 2 is emitted.
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 30.0, 0.0], [0.0, 5.0, 0.0, 0.0]]])
    tokens, counts = OPS.typical_verify(torch.tensor([[1, 3]]), logits, torch.tensor([2]), 1.0, 0.09, 0.3)
    assert tokens.tolist() == [[1, 2, -1]] and counts.tolist() == [1]
    # K = 0 emits the argmax (Medusa's greedy first token); vocab 1 accepts everything.
    tokens, counts = OPS.typical_verify(torch.zeros(1, 0, dtype=torch.long), logits[:, 2:], torch.tensor([0]),
                                        1.0, 0.09, 0.3)
    assert tokens.tolist() == [[1]] and counts.tolist() == [0]
    tokens, counts = OPS.typical_verify(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3, 1),
                                        torch.tensor([2]), 1.0, 0.09, 0.3)
    assert tokens.tolist() == [[0, 0, 0]] and counts.tolist() == [2]
    gen = torch.Generator().manual_seed(12)
    draft, logits, lens, _, _ = chain_case(gen, 4, 4, 49152, accept_bias=15.0, scale=3.0)
    args = (draft, logits, lens, 1.0, 0.09, 0.3)
    assert_same(OPS.typical_verify(*args), reference.typical_verify(*args))


def test_public_face_uses_generator_deterministically():
    from megatron_specdec.acceptance import stochastic_chain_verify, tree_verify

    gen = torch.Generator().manual_seed(13)
    draft, logits, lens, q, _ = chain_case(gen, 16, 5, 64)
    a = stochastic_chain_verify(draft, logits, lens, q, generator=torch.Generator().manual_seed(5))
    uniforms = torch.rand(16, 6, generator=torch.Generator().manual_seed(5))
    assert_same(a, reference.stochastic_chain_verify(draft, logits, lens, q, uniforms, 1.0, 0, 1.0))
    ids, parents, tlogits, nodes, _, _, depth = tree_case(gen, 8, 10, 12)
    b = tree_verify(ids, parents, tlogits, nodes, temperature=0.9, generator=torch.Generator().manual_seed(6))
    uniforms = torch.rand(8, 11, generator=torch.Generator().manual_seed(6))
    assert_same(b, reference.tree_verify_stochastic(ids, parents, tlogits, nodes, None, uniforms, depth, 0.9, 0, 1.0))

"""Tree drafting (inference/tree.py) on the small seeded random Llama of
test_speculative_generation: tree growth and node cap on hand-made log-probs, the verify
mask and positions, a tree verify forward equal to the chain forward along its path and a
compacted cache equal to the chain's, a top-1 tree equal to the chain, and tree generation
identical to plain greedy for EAGLE3 and Medusa at TP=1, TP=2 and PP=2 (random drafts, and
oracle trees that put the answer on a late branch with planned mistakes: exact counts)."""

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.inference.tree import TreeSpec, ancestors, grow_tree, verify_layout
import test_speculative_smollm2 as smollm2
from test_speculative_generation import (K, NEW, PROMPT, WRONG_AT, build, expected_accepts,
                                         identity_worker)

SPEC = TreeSpec(top_k=3, max_nodes=20)


def _all_candidates(root, table, depth, k):
    """Brute force of the growth rule: (score, token path) of every candidate."""
    level = [(s, (t,)) for s, t in zip(*root.topk(k))]
    out = list(level)
    for d in range(1, depth):
        children = []
        for score, path in sorted(level, key=lambda c: -c[0])[:k]:
            top, ids = table(path, d).topk(k)
            children += [(score + s, path + (t,)) for s, t in zip(top, ids)]
        out += children
        level = children
    return out


def test_grow_tree_hand_made():
    g = torch.Generator().manual_seed(0)
    vocab, depth = 50, 4
    rows = torch.randn(200, vocab, generator=g).log_softmax(-1)

    def table(path, d):  # log-probs after a token path: a fixed function of the path
        return rows[hash(tuple(int(t) for t in path)) % 200]

    def expand(candidates, frontier, d):
        assert (ancestors(candidates.parents)[frontier].sum(1) == d).all()
        return torch.stack([table(_path(candidates, int(f)), d) for f in frontier])

    root = rows[199]
    for spec in (TreeSpec(3), TreeSpec(3, max_nodes=9), TreeSpec(1), TreeSpec(4, max_nodes=4)):
        tree = grow_tree(root, expand, depth, spec)
        n = spec.num_nodes(depth)
        assert tree.tokens.shape == tree.parents.shape == (n,)
        assert all(-1 <= int(p) < i for i, p in enumerate(tree.parents))
        depths = ancestors(tree.parents).sum(1)
        assert int(depths.max()) <= depth and (depths[1:] >= depths[:-1]).all()
        # the kept nodes are the n best candidates by cumulative log-prob
        kept = {_path(tree, i) for i in range(n)}
        best = sorted(_all_candidates(root, table, depth, spec.top_k), key=lambda c: -c[0])[:n]
        assert kept == {tuple(int(t) for t in p) for _, p in best}
    assert TreeSpec(3).num_nodes(4) == 3 + 3 * 9 and TreeSpec(3, 9).num_nodes(4) == 9
    assert torch.equal(grow_tree(root, expand, depth, TreeSpec(1)).parents,
                       torch.tensor([-1, 0, 1, 2]))
    # A confidence floor keeps exactly the candidates at or above it (ancestor-closed), or none.
    everything = sorted(_all_candidates(root, table, depth, 3), key=lambda c: -c[0])
    floor = everything[7][0]
    tree = grow_tree(root, expand, depth, TreeSpec(3), floor=floor)
    kept = {_path(tree, i) for i in range(tree.tokens.numel())}
    assert kept == {tuple(int(t) for t in p) for score, p in everything if score >= floor}
    assert all(p[:-1] in kept for p in kept if len(p) > 1)
    empty = grow_tree(root, expand, depth, TreeSpec(3), floor=float(root.max()) + 1e-3)
    assert empty.tokens.numel() == 0


def _path(tree, i):
    """Token path from the root to node i."""
    path = []
    while i >= 0:
        path.append(int(tree.tokens[i]))
        i = int(tree.parents[i])
    return tuple(reversed(path))


def test_tree_spec_checks():
    with pytest.raises(ValueError, match="top_k"):
        TreeSpec(0).check(4, 100)
    with pytest.raises(ValueError, match="top_k"):
        TreeSpec(101).check(4, 100)
    with pytest.raises(ValueError, match="max_nodes 3 < depth 4"):
        TreeSpec(2, max_nodes=3).check(4, 100)
    with pytest.raises(ValueError, match="256"):
        TreeSpec(8).check(6, 100)
    TreeSpec(8, max_nodes=64).check(6, 100)


def test_verify_layout_hand_made():
    #        root
    #       /    \
    #      0      1
    #     / \     |
    #    2   3    4
    #    |
    #    5
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2], [-1, 0, -1, -1, -1, -1]])
    positions, mask = verify_layout(parents, prefix=torch.tensor([3, 1]))
    assert positions[0].tolist() == [3, 4, 4, 5, 5, 5, 6]
    assert mask.shape == (2, 1, 7, 10)
    # Row 1, a 2-node chain padded with root children, sits after its own 1-slot prefix.
    assert positions[1].tolist() == [1, 2, 3, 2, 2, 2, 2]
    assert mask[1, 0, :, 8:].all() and not mask[1, 0, :, :2].any()
    assert (~mask[1, 0, 2, 2:8]).int().tolist() == [1, 1, 0, 0, 0, 0]
    allowed = (~mask[0, 0]).int()
    assert allowed[:, :4].all()  # every query sees the prefix and the root (slot 3)
    assert allowed[:, 4:].tolist() == [
        [0, 0, 0, 0, 0, 0],  # root
        [1, 0, 0, 0, 0, 0],  # node 0
        [0, 1, 0, 0, 0, 0],  # node 1
        [1, 0, 1, 0, 0, 0],  # node 2
        [1, 0, 0, 1, 0, 0],  # node 3
        [0, 1, 0, 0, 1, 0],  # node 4
        [1, 0, 1, 0, 0, 1],  # node 5
    ]


@pytest.fixture(scope="module")
def eagle3():
    distributed.initialize(1, 1)
    return build("eagle3")


def test_tree_forward_and_compaction_equal_chain(eagle3):
    """Logits of a path through a verified tree equal the chain forward over that path, and
    after compacting the path the next forward equals the chain's next forward."""
    from megatron_specdec.inference.base_runner import BaseRunner

    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 3])
    tokens = torch.tensor([11, 12, 13, 14, 15, 16, 17])
    path = [0, 3, 6]  # root -> 0 -> 3 -> 6: not the first branch at depths 2 and 3
    pending, after = 9, 21
    n = len(PROMPT)
    tree_runner, chain_runner = BaseRunner(eagle3, 1, 64), BaseRunner(eagle3, 1, 64)
    tree_runner.step(torch.tensor([PROMPT]))
    chain_runner.step(torch.tensor([PROMPT]))
    positions, mask = verify_layout(parents[None], n)
    tree_out = tree_runner.step(torch.tensor([[pending] + tokens.tolist()]), positions, mask)
    chain_out = chain_runner.step(torch.tensor([[pending] + tokens[path].tolist()]))
    rows = torch.tensor([0] + [p + 1 for p in path])
    picked = tree_out.take(rows[None])
    # A chain attends query by query (as plain steps do), a tree through its mask: the same
    # sums in another fp32 order (|aux| reaches ~90 in this random model).
    torch.testing.assert_close(tree_out.logits[:, rows], chain_out.logits, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(picked.aux, chain_out.aux, atol=2e-4, rtol=1e-5)
    tree_runner.compact(n + 1, n + 1 + torch.tensor(path))
    assert tree_runner.lengths.tolist() == chain_runner.lengths.tolist() == [n + 1 + len(path)]
    next_tree = tree_runner.step(torch.tensor([[after]]))
    next_chain = chain_runner.step(torch.tensor([[after]]))
    torch.testing.assert_close(next_tree.logits, next_chain.logits, atol=1e-5, rtol=1e-5)


def test_top1_tree_is_the_chain(eagle3):
    from megatron_specdec.inference.generator import SpeculativeGenerator

    chain = SpeculativeGenerator(eagle3, K, policy="fixed").generate(PROMPT, 16)
    tree = SpeculativeGenerator(eagle3, K, tree=TreeSpec(1), policy="fixed").generate(PROMPT, 16)
    assert tree.tokens == chain.tokens and tree.accepted == chain.accepted
    with pytest.raises(ValueError, match="max_nodes"):
        SpeculativeGenerator(eagle3, K, tree=TreeSpec(2, max_nodes=2))


# TP 2: test_speculative_generation's chains check that layout by default.
@pytest.mark.parametrize("tp,pp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])
def test_tree_equals_greedy(tp, pp, tmp_path):
    out = tmp_path / "out.pt"
    distributed.spawn(identity_worker, tp * pp, tp, pp, str(out), SPEC, TreeSpec(3))
    for algo, got in torch.load(out, weights_only=False).items():
        assert got["plain"].tokens == got["greedy"], algo
        assert all(0 <= a <= K for a in got["plain"].accepted), algo
        if "oracle" in got:
            assert got["oracle"].tokens == got["greedy"], algo
            assert got["oracle"].accepted == expected_accepts(K, NEW, WRONG_AT), algo
        else:  # adaptive: unconfident trees are shallower, or empty (a plain step)
            assert len(set(got["plain"].drafted)) > 1, (algo, got["plain"].drafted)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_smollm2_tree_equals_greedy(tp, pp, default_hf_dir, chat_prompt_ids, tmp_path):
    """SmolLM2-135M-Instruct with a random EAGLE3 draft and random Medusa heads (16-node
    trees of top-4 branching), and oracle trees (top-2) over both drafters."""
    out = tmp_path / "out.pt"
    distributed.spawn(smollm2.worker, tp * pp, tp, pp, str(default_hf_dir), chat_prompt_ids,
                      str(out), TreeSpec(4, max_nodes=16), TreeSpec(2))
    got = torch.load(out, weights_only=False)
    for run in ("eagle3", "medusa", "eagle3_oracle", "medusa_oracle"):
        assert got[run].tokens == got["greedy"], run
        assert all(0 <= a <= smollm2.K for a in got[run].accepted), run
    for algo in ("eagle3", "medusa"):
        assert got[f"{algo}_oracle"].accepted == expected_accepts(
            smollm2.K, smollm2.NEW, smollm2.WRONG_AT), algo
    print({run: got[run].accepted for run in ("eagle3", "medusa")})

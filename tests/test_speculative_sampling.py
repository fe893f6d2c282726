"""Lossless speculative sampling on a small seeded random Llama: the distribution of the
tokens it emits equals plain sampling's (two-sample chi-square per position, which rejects a
deliberately wrong sampler that keeps every draft), chains and trees, with one-hot drafts and
with drafts sampled from the EAGLE3 draft's own distribution; a seed reproduces its output,
and bad sampling settings are refused by name."""

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.inference.oracle import OracleDrafter
from test_speculative_generation import HF, PROMPT, build

NEW, RUNS, K = 3, 700, 2
SETTINGS = dict(temperature=0.4, top_k=50, top_p=0.95)  # drafts accepted ~1 in 3


@pytest.fixture(scope="module")
def model():
    distributed.initialize(1, 1)
    return build("eagle3")


@pytest.fixture(scope="module")
def greedy(model):
    from megatron_specdec.inference.generation import plain_generate

    return plain_generate(model.base, [PROMPT], NEW + K + 1, HF["vocab_size"])[0]


@pytest.fixture(scope="module")
def reference(model):
    return plain_samples(model.base)


_PLAIN = {}  # sha256 of a base's weights -> its plain samples


def plain_samples(base):
    """Plain sampling's tokens over RUNS seeds (PROMPT, SETTINGS, NEW tokens), drawn once per
    base weights: test_dflash_generation's base is this seeded Llama too and reuses them."""
    import hashlib

    from megatron_specdec.inference.generation import plain_generate

    digest = hashlib.sha256()
    for name, t in sorted(base.state_dict().items()):
        if isinstance(t, torch.Tensor):
            digest.update(name.encode())
            digest.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    key = digest.hexdigest()
    if key not in _PLAIN:
        def plain(seed):
            rng = torch.Generator().manual_seed(seed)
            return plain_generate(base, [PROMPT], NEW, HF["vocab_size"], generator=rng,
                                  **SETTINGS)[0]

        _PLAIN[key] = _samples(plain)
    return _PLAIN[key]


def _generator(model, greedy, cls=None, tree=None):
    """Fixed-length chains (or trees whose deepest path is it, every other node wrong) of
    the base's greedy continuation (often accepted, often not)."""
    from megatron_specdec.inference.generator import SpeculativeGenerator

    generator = (cls or SpeculativeGenerator)(model, K, policy="fixed", tree=tree)
    generator.drafter = OracleDrafter(generator.drafter, [greedy], vocab_size=HF["vocab_size"])
    return generator


def _samples(run):
    return torch.tensor([run(seed) for seed in range(RUNS)])  # [RUNS, NEW]


def _same_distribution(a, b) -> float:
    """Smallest p-value over positions of a two-sample chi-square on the tokens either sample
    drew at least 10 times (the rest pooled)."""
    from scipy.stats import chi2_contingency

    worst = 1.0
    for pos in range(a.shape[1]):
        both = torch.cat([a[:, pos], b[:, pos]])
        ids, counts = both.unique(return_counts=True)
        common = ids[counts >= 10]
        table = [[int((x == t).sum()) for t in common] + [int((~torch.isin(x, common)).sum())]
                 for x in (a[:, pos], b[:, pos])]
        table = [list(col) for col in zip(*table) if sum(col) > 0]
        worst = min(worst, chi2_contingency(list(zip(*table)))[1])
    return worst


def test_speculative_sampling_matches_plain_sampling(model, greedy, reference):
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling

    speculative, accepted = _generator(model, greedy), []

    def spec(seed):
        result = speculative.generate(PROMPT, NEW, sampling=Sampling(**SETTINGS, seed=seed,
                                                                     one_hot_drafts=True))
        accepted.extend(result.accepted)
        return result.tokens

    own, own_accepted = SpeculativeGenerator(model, K, policy="fixed"), []

    def with_draft_probs(seed):  # the random EAGLE3 draft samples its drafts from q
        result = own.generate(PROMPT, NEW, sampling=Sampling(**SETTINGS, seed=seed))
        own_accepted.extend(result.accepted)
        return result.tokens

    class KeepsEveryDraft(SpeculativeGenerator):
        def _accept(self, call, drafts, counts, logits):
            tokens = torch.cat([drafts, drafts.new_full((1, 1), 0)], dim=1)
            return tokens, counts

    wrong = _generator(model, greedy, KeepsEveryDraft)

    def biased(seed):
        return wrong.generate(PROMPT, NEW, sampling=Sampling(**SETTINGS, seed=seed)).tokens

    # seeded: p-values measured 0.56 here, 3e-193 for `biased`
    assert _same_distribution(reference, _samples(spec)) > 1e-3
    assert 0.1 < sum(accepted) / (K * len(accepted)) < 0.9  # both branches were exercised
    assert _same_distribution(reference, _samples(with_draft_probs)) > 1e-3
    assert sum(own_accepted) > 0
    assert _same_distribution(reference, _samples(biased)) < 1e-6


def test_parallel_drafting_sampling_matches_plain_sampling(reference):
    """A parallel-drafting draft samples its whole chain from one forward's distributions:
    still plain sampling's distribution."""
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling

    own, accepted = SpeculativeGenerator(build("peagle"), K, policy="fixed"), []

    def with_draft_probs(seed):
        result = own.generate(PROMPT, NEW, sampling=Sampling(**SETTINGS, seed=seed))
        accepted.extend(result.accepted)
        return result.tokens

    assert _same_distribution(reference, _samples(with_draft_probs)) > 1e-3
    assert sum(accepted) > 0


def test_speculative_tree_sampling_matches_plain_sampling(model, greedy, reference):
    """Trees through tree_verify's recursive rejection over siblings: one-hot oracle trees
    (the greedy continuation on the deepest path, found after rejecting wrong siblings), and
    trees sampled from the random EAGLE3 draft with its probabilities (tree.sample_tree);
    a verifier that takes the greedy path instead is rejected."""
    from megatron_specdec.acceptance import tree_verify
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling
    from megatron_specdec.inference.tree import TreeSpec

    spec = TreeSpec(top_k=3, max_nodes=8)
    oracle, accepted = _generator(model, greedy, tree=spec), []

    def one_hot(seed):
        result = oracle.generate(PROMPT, NEW, sampling=Sampling(**SETTINGS, seed=seed))
        accepted.extend(result.accepted)
        return result.tokens

    own, own_accepted = SpeculativeGenerator(model, K, policy="fixed", tree=spec), []

    def with_draft_probs(seed):
        result = own.generate(PROMPT, NEW, sampling=Sampling(**SETTINGS, seed=seed))
        own_accepted.extend(result.accepted)
        return result.tokens

    class GreedyPath(SpeculativeGenerator):
        def _accept_tree(self, call, tokens, parents, logits, sizes):
            return tree_verify(tokens, parents, logits, sizes)

    wrong = _generator(model, greedy, GreedyPath, spec)

    def biased(seed):
        return wrong.generate(PROMPT, NEW, sampling=Sampling(**SETTINGS, seed=seed)).tokens

    assert _same_distribution(reference, _samples(one_hot)) > 1e-3
    assert 0.1 < sum(accepted) / (K * len(accepted)) < 0.9
    assert _same_distribution(reference, _samples(with_draft_probs)) > 1e-3
    assert sum(own_accepted) > 0
    assert _same_distribution(reference, _samples(biased)) < 1e-6


def test_sample_tree_draws_children_from_their_parent():
    """sample_tree: every node's distribution row is its parent's q, the node budget is
    filled in growth order, and the draws follow q (a token q gives no mass never appears)."""
    from megatron_specdec.inference.tree import TreeSpec, sample_tree

    g = torch.Generator().manual_seed(3)
    vocab, table = 40, torch.rand(64, 40, generator=torch.Generator().manual_seed(4))
    table[:, ::2] = 0  # odd tokens only
    table = table / table.sum(-1, keepdim=True)

    def q_after(candidates, i):
        return table[(int(candidates.tokens[i]) * 7 + i) % 64]

    def expand(candidates, frontier, d):
        return torch.stack([q_after(candidates, int(f)) for f in frontier])

    for spec, depth in ((TreeSpec(3), 3), (TreeSpec(3, max_nodes=7), 3), (TreeSpec(2), 1)):
        tree, probs = sample_tree(table[63], expand, depth, spec, g)
        n = spec.num_nodes(depth)
        assert tree.tokens.numel() == n and probs.shape == (n, vocab)
        assert (tree.tokens % 2 == 1).all()
        for i, p in enumerate(tree.parents.tolist()):
            assert p < i
            want = table[63] if p < 0 else q_after(tree, p)
            assert torch.equal(probs[i], want.to(probs.dtype))
    # A floor above the root's top probability drafts nothing.
    empty, probs = sample_tree(table[63], expand, 3, TreeSpec(3), g,
                               floor=float(table[63].max().log()) + 1e-3)
    assert empty.tokens.numel() == 0 and probs.shape == (0, vocab)


def test_same_seed_same_output(model):
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling
    from megatron_specdec.inference.tree import TreeSpec

    generator = SpeculativeGenerator(model, K, drafter_kind="ngram")
    run = [generator.generate(PROMPT, 30, sampling=Sampling(0.9, seed=s)).tokens
           for s in (7, 7, 8)]
    assert run[0] == run[1] and run[0] != run[2]
    tree = SpeculativeGenerator(model, K, tree=TreeSpec(3, max_nodes=8))
    run = [tree.generate(PROMPT, 30, sampling=Sampling(0.9, seed=s)).tokens for s in (7, 7, 8)]
    assert run[0] == run[1] and run[0] != run[2]


@pytest.mark.parametrize("settings,name", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"), (dict(temperature=1.0, top_k=-1), "top_k")])
def test_bad_sampling_settings_are_refused_by_name(settings, name):
    from megatron_specdec.inference.sampling import Sampling

    with pytest.raises(ValueError, match=name):
        Sampling(**settings)

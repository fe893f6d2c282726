"""Stochastic verification is lossless: emitted tokens follow the target distribution.

The target and the draft are small Markov chains (next-token tables P and Q over
V tokens), so the target distribution after any context is known exactly. For
many independent requests we check with a chi-square test that the first emitted
token follows P[root] and, given an accepted first token a, the second follows P[a].
Seeds are fixed, so each verdict is deterministic; a correct sampler passes at
p > 1e-3 and the wrong samplers below fail at p < 1e-6, showing the test has power.
"""
import numpy as np
import pytest
import scipy.stats
import torch

import megatron_specdec._C  # noqa: F401
from megatron_specdec.acceptance import reference, stochastic_chain_verify, tree_verify

V, ROOT, SAMPLES = 6, 0, 20000
PASS, FAIL = 1e-3, 1e-6


def markov_tables():
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(V, V, generator=gen, dtype=torch.float64) + 0.05
    p[ROOT, V - 1] = 0.0  # a token the target never emits after the root
    p = p / p.sum(-1, keepdim=True)
    q = 0.4 * p + 0.6 * torch.rand(V, V, generator=gen, dtype=torch.float64).softmax(-1) ** 2
    q = q / q.sum(-1, keepdim=True)
    return p, q


P, Q = markov_tables()


def chi2_pvalue(observed, expected_probs):
    """Goodness of fit per group (rows): observed counts [G, V] vs probabilities [G, V]."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected_probs, dtype=np.float64) * observed.sum(-1, keepdims=True)
    keep_rows = observed.sum(-1) > 0
    observed, expected = observed[keep_rows], expected[keep_rows]
    zero = expected == 0
    assert observed[zero].sum() == 0, "a zero-probability token was emitted"
    groups = observed.shape[0]
    return scipy.stats.chisquare(observed[~zero], expected[~zero], ddof=groups - 1).pvalue


def target_table(temperature, top_k, top_p):
    return reference.target_probs(P.log(), temperature, top_k, top_p)


def first_and_second(tokens, counts, table):
    first = np.bincount(tokens[:, 0].numpy(), minlength=V)
    p_first = chi2_pvalue(first[None], table[ROOT][None])
    more = counts >= 1
    pairs = np.zeros((V, V))
    np.add.at(pairs, (tokens[more, 0].numpy(), tokens[more, 1].numpy()), 1)
    p_second = chi2_pvalue(pairs, table)
    return p_first, p_second, int(more.sum())


def chain_inputs(k, sampled_draft, seed):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.full((SAMPLES,), ROOT)
    drafts, logits, probs = [], [], []
    for _ in range(k):
        q = Q[ctx]
        d = torch.multinomial(q, 1, generator=gen).squeeze(1) if sampled_draft else q.argmax(-1)
        drafts.append(d)
        logits.append(P[ctx].log())
        probs.append(q)
        ctx = d
    logits.append(P[ctx].log())
    return torch.stack(drafts, 1), torch.stack(logits, 1).float(), torch.stack(probs, 1).float()


def run_chain(impl, draft, logits, probs, sampling, seed):
    if impl == "fused":
        return stochastic_chain_verify(draft, logits, None, probs, generator=torch.Generator().manual_seed(seed),
                                       **sampling)
    uniforms = torch.rand(draft.shape[0], draft.shape[1] + 1, generator=torch.Generator().manual_seed(seed))
    return reference.stochastic_chain_verify(draft, logits, torch.full((draft.shape[0],), draft.shape[1]), probs,
                                             uniforms, sampling["temperature"], sampling["top_k"], sampling["top_p"])


SETTINGS = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.8, top_k=4, top_p=0.95)]


@pytest.mark.parametrize("impl", ["fused", "reference"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["plain", "T0.8-topk4-topp0.95"])
@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "greedy_draft"])
def test_chain_matches_target(impl, sampling, with_q):
    draft, logits, probs = chain_inputs(3, sampled_draft=with_q, seed=1)
    tokens, counts = run_chain(impl, draft, logits, probs if with_q else None, sampling, seed=2)
    p_first, p_second, n_second = first_and_second(tokens, counts, target_table(**sampling))
    assert n_second > SAMPLES // 10  # enough accepted rows for the conditional test
    assert p_first > PASS and p_second > PASS, (p_first, p_second)


def naive_sampler(draft, logits, probs, seed):
    """Wrong on purpose: keep the draft when p(d) > q(d), else resample from p (no residual)."""
    gen = torch.Generator().manual_seed(seed)
    p = logits[:, 0].double().softmax(-1)
    d = draft[:, 0]
    keep = p.gather(1, d[:, None]).squeeze(1) > probs[:, 0].double().gather(1, d[:, None]).squeeze(1)
    resampled = torch.multinomial(p, 1, generator=gen).squeeze(1)
    return torch.where(keep, d, resampled)


def test_chi_square_rejects_wrong_samplers():
    draft, logits, probs = chain_inputs(3, sampled_draft=True, seed=1)
    first = np.bincount(naive_sampler(draft, logits, probs, seed=3).numpy(), minlength=V)
    assert chi2_pvalue(first[None], P[ROOT][None]) < FAIL
    # The real op told the wrong draft distribution (the target's own) for tokens sampled
    # from Q: it accepts everything and emits Q. (Declaring the draft greedy instead
    # would still be lossless: a one-hot q suits any draft token.)
    wrong = logits[:, :3].softmax(-1)
    tokens, _ = stochastic_chain_verify(draft, logits, None, wrong, generator=torch.Generator().manual_seed(2))
    first = np.bincount(tokens[:, 0].numpy(), minlength=V)
    assert chi2_pvalue(first[None], P[ROOT][None]) < FAIL


def tree_inputs(sampled_draft, seed, branching=(3, 2)):
    """Root with branching[0] children, each with branching[1] children, as flat arrays."""
    gen = torch.Generator().manual_seed(seed)
    ids, parents, probs, rows = [], [], [], [torch.full((SAMPLES,), ROOT)]

    def children(parent, ctx, count):
        q = Q[ctx]
        if sampled_draft:  # SpecInfer: siblings drawn independently from q
            toks = torch.multinomial(q, count, replacement=True, generator=gen)
        else:  # EAGLE: the top-`count` distinct candidates
            toks = q.topk(count, dim=-1).indices
        made = []
        for j in range(count):
            ids.append(toks[:, j])
            parents.append(parent)
            probs.append(q)
            rows.append(toks[:, j])
            made.append(len(ids) - 1)
        return made

    for node in children(-1, rows[0], branching[0]):
        children(node, ids[node], branching[1])
    n = len(ids)
    logits = torch.stack([P[r].log() for r in rows], 1).float()
    par = torch.tensor(parents).expand(SAMPLES, n).contiguous()
    return torch.stack(ids, 1), par, logits, torch.stack(probs, 1).float()


@pytest.mark.parametrize("sampling", SETTINGS, ids=["plain", "T0.8-topk4-topp0.95"])
@pytest.mark.parametrize("with_q", [True, False], ids=["specinfer_draft_probs", "eagle_topk_greedy_draft"])
def test_tree_matches_target(sampling, with_q):
    ids, parents, logits, probs = tree_inputs(sampled_draft=with_q, seed=4)
    tokens, counts, path = tree_verify(ids, parents, logits, None, probs if with_q else None,
                                       generator=torch.Generator().manual_seed(5), **sampling)
    p_first, p_second, n_second = first_and_second(tokens, counts, target_table(**sampling))
    assert n_second > SAMPLES // 10
    assert p_first > PASS and p_second > PASS, (p_first, p_second)
    accepted = counts >= 1  # the path's first node carries the first emitted token
    assert torch.equal(ids[accepted].gather(1, path[accepted, :1]).squeeze(1), tokens[accepted, 0])


def test_tree_chi_square_rejects_first_child_only_sampler():
    """Trying only the first sibling but sampling from p on rejection is biased towards it."""
    ids, parents, logits, _ = tree_inputs(sampled_draft=False, seed=4)
    gen = torch.Generator().manual_seed(6)
    p = logits[:, 0].double().softmax(-1)
    first_child = ids[:, 0]
    u = torch.rand(SAMPLES, generator=gen, dtype=torch.float64)
    keep = u < p.gather(1, first_child[:, None]).squeeze(1)
    out = torch.where(keep, first_child, torch.multinomial(p, 1, generator=gen).squeeze(1))
    first = np.bincount(out.numpy(), minlength=V)
    assert chi2_pvalue(first[None], P[ROOT][None]) < FAIL

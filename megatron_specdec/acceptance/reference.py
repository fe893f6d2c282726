"""Pure-PyTorch reference implementations of the acceptance ops.

They define the semantics the fused C++/CUDA ops must reproduce token for token,
and they are the fallback when the extension is not built. Every probability is
computed in float64: the fused ops use their own exp and summation order. The
C++ ops are float64 throughout, so an accept test or an inverse-CDF draw lands
between the two roundings with a chance below ~1e-12. The CUDA statistics pass
sums each thread's ~60 logits with float32 exp2 (then float64 across threads): a
row's normaliser is within ~1e-6 relative, so that chance is ~1e-6 per decision.

Inputs are assumed valid here; ``validation.py`` checks them.
Random numbers come in as ``uniforms`` (float32 in [0, 1)), drawn by the caller.
"""
import torch

__all__ = [
    "target_probs",
    "tree_depths",
    "greedy_chain_verify_ids",
    "greedy_chain_verify",
    "stochastic_chain_verify",
    "tree_verify_greedy",
    "tree_verify_stochastic",
    "typical_verify",
]


def target_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """float64 target distribution over the last dim after temperature, top-k, top-p.

    top-k keeps every logit >= the k-th largest; top-p keeps every logit >= the
    logit at which the sorted cumulative probability first reaches top_p. Both
    cuts are thresholds on the logit, so ties are kept together.
    """
    x = logits.double() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x = x.sort(dim=-1, descending=True).values
        cum = sorted_x.softmax(-1).cumsum(-1)
        last = (cum < top_p).sum(-1, keepdim=True).clamp(max=vocab - 1)
        x = x.masked_fill(x < sorted_x.gather(-1, last), float("-inf"))
    return x.softmax(-1)


def _sample(weights, uniform):
    """Inverse-CDF draw: the first index whose cumulative weight exceeds u * total."""
    cdf = weights.cumsum(-1)
    target = uniform.double().unsqueeze(-1) * cdf[..., -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def _emit(prefix_ids, counts, final):
    """tokens [B, K+1]: the accepted prefix, then `final` at index `counts`, then -1."""
    batch, width = prefix_ids.shape[0], prefix_ids.shape[1] + 1
    pos = torch.arange(width, device=counts.device)
    tokens = torch.full((batch, width), -1, dtype=torch.long, device=counts.device)
    tokens[:, :-1] = torch.where(pos[:-1] < counts[:, None], prefix_ids, -1)
    tokens.scatter_(1, counts[:, None], final[:, None])
    return tokens


def _prefix_counts(accept, draft_lens):
    """Length of the accepted prefix, stopping at each request's draft length."""
    pos = torch.arange(accept.shape[1], device=accept.device)
    accept = accept & (pos < draft_lens[:, None])
    return accept.long().cumprod(1).sum(1)


def _drafted(draft_ids, draft_lens):
    """Draft ids with the padding after each request's length replaced by 0, safe to index with."""
    pos = torch.arange(draft_ids.shape[1], device=draft_ids.device)
    return torch.where(pos < draft_lens[:, None], draft_ids, 0)


def greedy_chain_verify_ids(draft_ids, target_ids, draft_lens):
    """Greedy chain verification against precomputed target argmax ids [B, K+1]."""
    k = draft_ids.shape[1]
    counts = _prefix_counts(draft_ids == target_ids[:, :k], draft_lens)
    final = target_ids.gather(1, counts[:, None]).squeeze(1)
    return _emit(draft_ids, counts, final), counts


def greedy_chain_verify(draft_ids, target_logits, draft_lens):
    """Greedy chain verification against target logits [B, K+1, V]."""
    return greedy_chain_verify_ids(draft_ids, target_logits.argmax(-1), draft_lens)


def stochastic_chain_verify(
    draft_ids, target_logits, draft_lens, draft_probs, uniforms, temperature, top_k, top_p
):
    """Lossless rejection sampling along a chain (Leviathan et al., Chen et al.).

    Draft i is accepted when u_i * q(d_i) < p(d_i), i.e. with probability
    min(1, p/q); q is one-hot when ``draft_probs`` is None. At the first rejection
    the emitted token is drawn from max(0, p - q) with ``uniforms[:, K]``; after
    all ``draft_lens`` drafts the bonus token is drawn from p at that position.
    """
    batch, k = draft_ids.shape
    rows = torch.arange(batch, device=draft_ids.device)
    ids = _drafted(draft_ids, draft_lens)
    p = target_probs(target_logits, temperature, top_k, top_p)
    p_draft = p[:, :k].gather(-1, ids[..., None]).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, ids[..., None]).squeeze(-1).double()
    u = uniforms.double()
    counts = _prefix_counts(u[:, :k] * q_draft < p_draft, draft_lens)
    weights = p[rows, counts]
    if k > 0:
        at = counts.clamp(max=k - 1)
        if draft_probs is None:
            q_row = torch.zeros_like(weights)
            q_row[rows, ids[rows, at]] = 1.0
        else:
            q_row = draft_probs[rows, at].double()
        residual = (weights - q_row).clamp_min(0.0)
        use = (counts < draft_lens) & (residual.sum(-1) > 0)
        weights = torch.where(use[:, None], residual, weights)
    final = _sample(weights, uniforms[:, k])
    return _emit(draft_ids, counts, final), counts


def tree_depths(parents, num_nodes):
    """Depth of every valid node (root children have depth 1); padding nodes get 0."""
    batch, n = parents.shape
    depth = torch.zeros(batch, n + 1, dtype=torch.long, device=parents.device)
    for i in range(n):
        depth[:, i + 1] = depth.gather(1, _parent_rows(parents, i)).squeeze(1) + 1
    valid = torch.arange(n, device=parents.device) < num_nodes[:, None]
    return torch.where(valid, depth[:, 1:], 0)


def _parent_rows(parents, i):
    """Logits row of node i's parent ([B, 1]); padding nodes' arbitrary parents are clamped."""
    return (parents[:, i : i + 1] + 1).clamp(0, i)


def _tree_emit(tree_ids, parents, best, counts, final, max_depth):
    """Walk back from the chosen node to write the path tokens, their node ids and `final`."""
    batch = tree_ids.shape[0]
    tokens = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=tree_ids.device)
    path = torch.full((batch, max_depth), -1, dtype=torch.long, device=tree_ids.device)
    node = best.clone()
    for step in range(max_depth):
        level = counts - 1 - step
        rows = (level >= 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        tokens[rows, level[rows]] = tree_ids[rows, node[rows]]
        path[rows, level[rows]] = node[rows]
        node[rows] = parents[rows, node[rows]]
    tokens.scatter_(1, counts[:, None], final[:, None])
    return tokens, counts, path


def tree_verify_greedy(tree_ids, parents, target_logits, num_nodes, max_depth):
    """Greedy tree verification: the deepest path whose tokens match the target argmax.

    Node i is accepted when its parent is and ``tree_ids[i] == argmax(row parent+1)``;
    among the deepest accepted nodes the lowest index wins. The final token is the
    argmax after the chosen node (row 0 when nothing is accepted).
    """
    batch, n = tree_ids.shape
    argmax = target_logits.argmax(-1)
    ok = torch.zeros(batch, n + 1, dtype=torch.bool, device=tree_ids.device)
    ok[:, 0] = True
    valid = torch.arange(n, device=tree_ids.device) < num_nodes[:, None]
    for i in range(n):
        up = _parent_rows(parents, i)
        match = tree_ids[:, i] == argmax.gather(1, up).squeeze(1)
        ok[:, i + 1] = ok.gather(1, up).squeeze(1) & match & valid[:, i]
    depth = torch.where(ok[:, 1:], tree_depths(parents, num_nodes), 0)
    padded = torch.cat([depth.new_zeros(batch, 1), depth], 1)
    counts = padded.max(1).values
    best = padded.argmax(1) - 1
    final = argmax.gather(1, (best + 1)[:, None]).squeeze(1)
    return _tree_emit(tree_ids, parents, best, counts, final, max_depth)


def tree_verify_stochastic(
    tree_ids, parents, target_logits, num_nodes, draft_probs, uniforms, max_depth,
    temperature, top_k, top_p,
):
    """Multi-candidate recursive rejection sampling over a draft tree (SpecInfer, EAGLE).

    From the root, the children of the current node are tried in index order with
    residual weights r (initially p, total R = 1): child c with token t is accepted
    when u_c * q_c(t) * R < r(t); on rejection r <- max(0, r - q_c * R) and R <- sum(r).
    On acceptance the walk moves to c with r = p(row c+1). When no child is accepted
    the final token is drawn from r with ``uniforms[:, N]``. q_c is one-hot at t when
    ``draft_probs`` is None; otherwise siblings must be drawn independently from their q.
    """
    batch, n = tree_ids.shape
    p = target_probs(target_logits, temperature, top_k, top_p)
    u = uniforms.double()
    counts = torch.zeros(batch, dtype=torch.long, device=tree_ids.device)
    best = torch.full_like(counts, -1)
    final = torch.zeros_like(counts)
    for b in range(batch):
        valid = int(num_nodes[b])
        children = [[] for _ in range(valid + 1)]
        for i in range(valid):
            children[int(parents[b, i]) + 1].append(i)
        node, depth = -1, 0
        r, total = p[b, 0], 1.0
        tried = 0
        while tried < len(children[node + 1]):
            c = children[node + 1][tried]
            t = int(tree_ids[b, c])
            q = None if draft_probs is None else draft_probs[b, c].double()
            q_t = 1.0 if q is None else float(q[t])
            if float(u[b, c]) * q_t * total < float(r[t]):
                node, depth, tried = c, depth + 1, 0
                r, total = p[b, c + 1], 1.0
                continue
            if q is None:
                q = torch.zeros_like(r)
                q[t] = 1.0
            new_r = (r - q * total).clamp_min(0.0)
            new_total = float(new_r.sum())
            if new_total > 0:
                r, total = new_r, new_total
            tried += 1
        counts[b], best[b] = depth, node
        final[b] = _sample(r, u[b, n])
    return _tree_emit(tree_ids, parents, best, counts, final, max_depth)


def typical_verify(draft_ids, target_logits, draft_lens, temperature, eps, alpha):
    """Medusa typical acceptance along a chain.

    Draft i is accepted when p_i(d_i) > min(eps, alpha * exp(-H(p_i))) with
    p_i = softmax(logits_i / temperature) and H the exact entropy. The token after
    the accepted prefix is the target argmax there (Medusa's greedy first token),
    so every call emits at least one token.
    """
    k = draft_ids.shape[1]
    p = target_probs(target_logits[:, :k], temperature)
    entropy = -torch.special.xlogy(p, p).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, eps), alpha * torch.exp(-entropy))
    p_draft = p.gather(-1, _drafted(draft_ids, draft_lens)[..., None]).squeeze(-1)
    counts = _prefix_counts(p_draft > threshold, draft_lens)
    argmax = target_logits.argmax(-1)
    final = argmax.gather(1, counts[:, None]).squeeze(1)
    return _emit(draft_ids, counts, final), counts

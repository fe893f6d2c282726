"""Draft trees: how a drafter grows one, and how the base verifies one in a single forward.

Growth follows EAGLE-2's dynamic tree. Depth 1 holds the top-k tokens after the root (the
pending token); at each further depth the k candidates of the previous depth with the highest
cumulative draft log-probability are expanded, each into its own top-k children, and all k*k
children stay candidates. Finally the `max_nodes` candidates of highest cumulative log-prob
are kept. A child's score is its parent's plus a log-prob <= 0, so with ties going to the
earlier (shallower) candidate the kept set always contains every kept node's ancestors.
The node count is at most k + (depth - 1) * k * k, capped at `max_nodes`. With a confidence
floor (an adaptive DraftPolicy) only candidates whose cumulative probability reaches it are
expanded or kept, so an unconfident draft grows a small tree, or none (a plain step).

For lossless speculative sampling with draft probabilities (`sample_tree`) the tree must be
what `acceptance.tree_verify` assumes: the children of a node are independent draws from the
distribution q at that node, tried in index order, each verified against q. Top-k children
are not draws from q (verifying them against q would bias the output towards them), and
neither are draws without replacement (the second child's distribution is q renormalised
without the first, not q), nor any set filtered by the children's own values (a floor or a
node cap by score). So `sample_tree` draws each expanded node's children i.i.d. from its q
(with replacement: a repeated token is a second, independent proposal), and decides how many
children a node gets from things fixed before they are drawn: its own path's cumulative
probability (which nodes of a depth are expanded) and the node budget (filled in growth
order). One-hot drafting (no draft probabilities) needs none of this: any deterministic tree
of distinct siblings is lossless, so it uses the greedy `grow_tree`.

The flattened tree lists nodes in growth order (parents before children), `parents[i]` = -1
for children of the root: the layout `acceptance.tree_verify` takes. The base verifies
[root, node_0 .. node_{N-1}] in one forward (one tree per row of a batch, each after its own
cached prefix, padded to the largest with extra root children that nothing reads): each node
attends to the cached prefix, the root, its ancestors and itself, at RoPE position
prefix + depth, which is exactly the context and position it would have had in a chain, so an
accepted path's logits are the chain's.
"""

from dataclasses import dataclass
import math
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from megatron_specdec.acceptance.validation import MAX_TREE_NODES


@dataclass(frozen=True)
class TreeSpec:
    """Top-k branching at every depth; depth = the generator's number of draft tokens."""

    top_k: int
    max_nodes: Optional[int] = None  # None: keep every candidate

    def num_nodes(self, depth: int) -> int:
        candidates = self.top_k + (depth - 1) * self.top_k ** 2
        return candidates if self.max_nodes is None else min(candidates, self.max_nodes)

    def check(self, depth: int, vocab_size: int):
        """Errors naming the setting, before any forward runs."""
        if not 1 <= self.top_k <= vocab_size:
            raise ValueError(f"tree top_k must be in [1, {vocab_size}] (the draft vocabulary), "
                             f"got {self.top_k}")
        if self.max_nodes is not None and self.max_nodes < depth:
            raise ValueError(f"tree max_nodes {self.max_nodes} < depth {depth}: the deepest "
                             "draft tokens could never be kept")
        if self.num_nodes(depth) > MAX_TREE_NODES:
            raise ValueError(f"a tree of top_k {self.top_k} and depth {depth} has "
                             f"{self.num_nodes(depth)} nodes > {MAX_TREE_NODES} (tree_verify's "
                             "limit): set max_nodes")


@dataclass
class DraftTree:
    """tokens, parents: int64 [N] in growth order (parents[i] < i, -1 = child of the root)."""

    tokens: Tensor
    parents: Tensor


def grow_tree(root: Tensor, expand: Callable, depth: int, spec: TreeSpec,
              floor: float = float("-inf")) -> DraftTree:
    """root: log-probs [V] of the token after the root. expand(candidates, frontier, d): the
    log-probs [len(frontier), V] of the children of the candidates `frontier` (indices into
    `candidates`, a DraftTree of everything grown so far), all at depth d. Candidates whose
    cumulative log-prob is below `floor` are neither expanded nor kept. Tokens come back in
    the id space of the log-probs."""
    k = spec.top_k
    scores, tokens = root.float().topk(k)
    parents = torch.full((k,), -1, dtype=torch.long, device=root.device)
    frontier = torch.arange(k, device=root.device)[scores >= floor]
    for d in range(1, depth):
        if not frontier.numel():
            break
        logprobs = expand(DraftTree(tokens, parents), frontier, d)
        top, ids = logprobs.float().clamp(max=0).topk(k, dim=-1)
        child_scores = (scores[frontier, None] + top).flatten()
        first = tokens.numel()
        tokens = torch.cat([tokens, ids.flatten()])
        parents = torch.cat([parents, frontier.repeat_interleave(k)])
        scores = torch.cat([scores, child_scores])
        best = child_scores.topk(min(k, child_scores.numel()))
        frontier = first + best.indices[best.values >= floor].sort().values
    order = scores.sort(descending=True, stable=True).indices
    order = order[scores[order] >= floor]
    keep = order[: spec.num_nodes(depth)].sort().values
    # One spare entry, left at -1, is where the root's children (parent -1) look up.
    new_index = torch.full((tokens.numel() + 1,), -1, dtype=torch.long, device=root.device)
    new_index[keep] = torch.arange(keep.numel(), device=root.device)
    return DraftTree(tokens[keep], new_index[parents[keep]])


def sample_tree(root: Tensor, expand: Callable, depth: int, spec: TreeSpec, generator,
                floor: float = float("-inf")) -> Tuple[DraftTree, Tensor]:
    """A tree sampled from the draft (module notes), and the distribution each node was drawn
    from [N, V] (its parent's q). root: q [V] after the root; expand(candidates, frontier, d):
    q [len(frontier), V] at the candidates `frontier`, all at depth d. Each expanded node
    gets spec.top_k children drawn i.i.d. from its q; at each depth the top_k nodes of the
    newest depth with the highest cumulative draft probability are expanded, those below
    `floor` (log) not; the root is expanded unless q's top probability is below the floor.
    Nodes past spec.num_nodes(depth), in growth order, are not drawn."""
    k, budget, device = spec.top_k, spec.num_nodes(depth), root.device
    if math.log(max(float(root.max()), 1e-300)) < floor:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return DraftTree(empty, empty.clone()), root.new_zeros(0, root.numel())
    width = min(k, budget)
    tokens = torch.multinomial(root, width, replacement=True, generator=generator)
    parents = torch.full((width,), -1, dtype=torch.long, device=device)
    dists = [root.expand(width, -1)]
    scores = root[tokens].double().log()
    level = torch.arange(width, device=device)
    for d in range(1, depth):
        room = budget - tokens.numel()
        ranked = level[scores[level].argsort(descending=True, stable=True)][:k]
        frontier = ranked[scores[ranked] >= floor].sort().values
        if room <= 0 or not frontier.numel():
            break
        q = expand(DraftTree(tokens, parents), frontier, d)
        drawn = torch.multinomial(q, k, replacement=True, generator=generator)
        rows = torch.arange(frontier.numel(), device=device).repeat_interleave(k)[:room]
        children = drawn.flatten()[:room]
        level = tokens.numel() + torch.arange(children.numel(), device=device)
        tokens = torch.cat([tokens, children])
        parents = torch.cat([parents, frontier[rows]])
        dists.append(q[rows])
        scores = torch.cat([scores, scores[frontier[rows]] + q[rows, children].double().log()])
    return DraftTree(tokens, parents), torch.cat(dists)


def ancestors(parents: Tensor) -> Tensor:
    """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    n = parents.numel()
    table = torch.eye(n, dtype=torch.bool, device=parents.device)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            table[i] |= table[p]
    return table


def verify_layout(parents: Tensor, prefix):
    """RoPE positions [b, N + 1] and attention mask [b, 1, N + 1, max(prefix) + N + 1] (True =
    may not attend) of the verify forward over [root, nodes] of one tree per row (parents
    [b, N]; a row's padding nodes have parent -1) appended after prefix[b] (or int) cached
    slots of that row."""
    b, n = parents.shape
    prefix = torch.as_tensor(prefix).cpu().expand(b)
    end = int(prefix.max()) + n + 1
    positions = torch.empty(b, n + 1, dtype=torch.long, device=parents.device)
    mask = torch.ones(b, 1, n + 1, end, dtype=torch.bool, device=parents.device)
    for row in range(b):
        start = int(prefix[row])
        seen = ancestors(parents[row])
        positions[row, 0] = start
        positions[row, 1:] = start + seen.sum(1)
        mask[row, 0, :, :start + 1] = False
        mask[row, 0, 1:, start + 1: start + n + 1] = ~seen
    return positions, mask

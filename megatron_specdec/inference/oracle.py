"""A drafter that knows the answer: it proposes a given continuation (the base's own greedy
output), optionally wrong at chosen positions, while still running a real drafter so that
drafter's cache goes through every accept and rollback.

Used to exercise multi-token acceptance and rollback with exact expected acceptance counts
(tests), and to measure the ceiling of the draft-verify machinery itself: the tokens/s a
perfect draft of this cost would reach in this runtime (bench).

Its tree keeps the real drafter's tree shape and puts the continuation on the path to the
deepest node grown last (rarely the first branch, so the accepted path's cache entries are
not already contiguous); every other node gets a wrong token."""

import torch

from megatron_specdec.inference.tree import DraftTree, ancestors


class OracleDrafter:
    def __init__(self, inner, continuations, wrong_at=None, vocab_size: int = None):
        """continuations: per row of the batch, the token ids the base will emit after its
        prompt; positions past the end are proposed as token 0. wrong_at: per row, emitted
        positions proposed as (token + 1) % vocab."""
        self.inner, self.continuations = inner, [list(c) for c in continuations]
        self.wrong_at = [set(w) for w in wrong_at or [()] * len(self.continuations)]
        self.vocab_size = vocab_size
        if any(self.wrong_at) and vocab_size is None:
            raise ValueError("wrong_at needs vocab_size")
        self.emitted = []  # per row

    def start(self, prompt, lengths, pending, out, max_length):
        self.inner.start(prompt, lengths, pending, out, max_length)
        self.emitted = [1] * prompt.shape[0]

    def _answer(self, k, row):
        """Row's next k tokens as proposed (wrong at its `wrong_at`)."""
        ids, continuation, emitted = [], self.continuations[row], self.emitted[row]
        for pos in range(emitted, emitted + k):
            token = continuation[pos] if pos < len(continuation) else 0
            ids.append((token + 1) % self.vocab_size if pos in self.wrong_at[row] else token)
        return ids

    def propose(self, k, policy=None):
        own, _ = self.inner.propose(k)
        drafts = torch.tensor([self._answer(k, row) for row in range(len(self.emitted))],
                              dtype=own.dtype, device=own.device)
        return drafts, torch.full((len(self.emitted),), k, device=own.device)

    def propose_tree(self, depth, spec, floor=float("-inf"), row=0):
        if self.vocab_size is None:
            raise ValueError("an oracle tree needs vocab_size (for its wrong tokens)")
        own = self.inner.propose_tree(depth, spec, row=row)  # full: the answer needs depth
        seen = ancestors(own.parents)
        depths = seen.sum(1)
        deepest = int((depths == depths.max()).nonzero().max())
        answer = torch.tensor(self._answer(int(depths.max()), row),
                              device=own.tokens.device)
        tokens = (answer[depths - 1] + 1) % self.vocab_size  # wrong everywhere ...
        path = seen[deepest]
        tokens[path] = answer[depths[path] - 1]  # ... but along the chosen path
        return DraftTree(tokens, own.parents)

    def keep_rows(self, rows):
        self.inner.keep_rows(rows)
        rows = rows.tolist()
        self.continuations = [self.continuations[r] for r in rows]
        self.wrong_at = [self.wrong_at[r] for r in rows]
        self.emitted = [self.emitted[r] for r in rows]

    def accept(self, tokens, counts, out):
        self.inner.accept(tokens, counts, out)
        self.emitted = [e + c for e, c in zip(self.emitted, counts.tolist())]

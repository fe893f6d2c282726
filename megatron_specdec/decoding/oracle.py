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

from megatron_specdec.decoding.tree import DraftTree, ancestors


class OracleDrafter:
    def __init__(self, inner, continuation, wrong_at=(), vocab_size: int = None):
        """continuation: token ids the base will emit after the prompt; positions past its end
        are proposed as token 0. wrong_at: emitted positions proposed as (token + 1) % vocab."""
        self.inner, self.continuation = inner, list(continuation)
        self.wrong_at, self.vocab_size = set(wrong_at), vocab_size
        if self.wrong_at and vocab_size is None:
            raise ValueError("wrong_at needs vocab_size")
        self.emitted = 0

    def start(self, prompt, pending, out, max_length):
        self.inner.start(prompt, pending, out, max_length)
        self.emitted = 1

    def _answer(self, k):
        """The next k emitted tokens as proposed (wrong at `wrong_at`)."""
        ids = []
        for pos in range(self.emitted, self.emitted + k):
            token = self.continuation[pos] if pos < len(self.continuation) else 0
            ids.append((token + 1) % self.vocab_size if pos in self.wrong_at else token)
        return ids

    def propose(self, k, policy=None):
        own = self.inner.propose(k)
        return torch.tensor([self._answer(k)], dtype=own.dtype, device=own.device)

    def propose_tree(self, depth, spec, floor=float("-inf")):
        if self.vocab_size is None:
            raise ValueError("an oracle tree needs vocab_size (for its wrong tokens)")
        own = self.inner.propose_tree(depth, spec)  # the full tree: the answer needs depth
        seen = ancestors(own.parents)
        depths = seen.sum(1)
        deepest = int((depths == depths.max()).nonzero().max())
        answer = torch.tensor(self._answer(int(depths.max())), device=own.tokens.device)
        tokens = (answer[depths - 1] + 1) % self.vocab_size  # wrong everywhere ...
        path = seen[deepest]
        tokens[path] = answer[depths[path] - 1]  # ... but along the chosen path
        return DraftTree(tokens, own.parents)

    def accept(self, num_accepted, new_tokens, out):
        self.inner.accept(num_accepted, new_tokens, out)
        self.emitted += num_accepted + 1

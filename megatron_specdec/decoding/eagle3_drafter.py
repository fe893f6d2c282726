"""EAGLE3 chain drafting over the draft module's own KV cache (last pipeline stage).

Indexing follows training (spec_model / eagle3_module): the draft at position t reads
fc(aux_t) and the embedding of token t+1, and predicts token t+2. The cache holds one entry
per *real* position (base states known); a chain step j (position t+j) reads the previous
step's output hidden state and the embedding of the token it just drafted, and attends to
all real entries plus the chain so far, exactly the keys its training-time-test step sees.
Chain entries are dropped after drafting; once the base has verified, the accepted positions
are re-fed with their real aux states. Slot index = position, so one causal mask serves both.

A tree (tree.py) is drafted the same way, one draft forward per depth over the expanded
frontier: a node at depth d runs at position t+d on its parent's output hidden state and
its own token's embedding, attending to the real entries and the entries of its ancestors,
so every root-to-node path sees exactly what the chain along it would.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron_specdec.decoding.draft_policy import draft_chain
from megatron_specdec.decoding.tree import (
    DraftTree,
    TreeSpec,
    ancestors,
    grow_tree,
)
from megatron_specdec.layers.vocab_parallel import (
    vocab_parallel_argmax,
    vocab_parallel_gather,
    vocab_parallel_log_probs,
)


class Eagle3Drafter:
    def __init__(self, model, embedding):
        """model: the last stage of a SpeculativeGPTModel with an EAGLE3 draft; embedding:
        the base's token embedding on this stage (see embedding.py)."""
        self.module = model.draft
        self.embedding = embedding
        self.rotary = model.rotary_pos_emb
        self.target_ids = self.module.target_ids()
        self.kv = [[] for _ in self.module.layers]
        self.length = 0  # real positions in the cache
        self._rope: Optional[Tensor] = None
        self._last = None  # (hidden [1, b, h], logits [1, b, Dp/TP]) of the newest position

    def _cached(self) -> int:
        blocks = self.kv[0]
        return sum(k.shape[0] for k, _ in blocks)

    def _truncate(self, n: int):
        for blocks in self.kv:
            if blocks:
                keys = torch.cat([k for k, _ in blocks])[:n]
                values = torch.cat([v for _, v in blocks])[:n]
                blocks[:] = [(keys, values)]

    def _forward(self, hidden: Tensor, next_tokens: Tensor, positions: Tensor, mask: Tensor,
                 last_only: bool = False):
        """Append s cache entries: hidden [s, b, h], next_tokens [b, s], RoPE positions [s],
        mask [1, 1, s, cached + s]. Returns (hidden out, logits) [s (or 1: last_only), b, ...]."""
        embeds = self.embedding(input_ids=next_tokens, position_ids=None)
        return self.module.step(embeds, hidden, self._rope[positions], mask, self.kv, last_only)

    def _step(self, hidden: Tensor, next_tokens: Tensor):
        """Append positions [cached, cached + s): hidden [s, b, h], next_tokens [b, s]."""
        s = hidden.shape[0]
        start = self._cached()
        q = torch.arange(start, start + s, device=hidden.device)
        keys = torch.arange(start + s, device=hidden.device)[None, :]
        mask = (keys > q[:, None])[None, None]
        hidden, logits = self._forward(hidden, next_tokens, q, mask, last_only=True)
        self._last = (hidden[-1:], logits)

    def _argmax(self, logits: Tensor) -> Tensor:
        """Target ids [b] of the draft's top token (logits [1, b, Dp/TP], vocab-parallel)."""
        draft_ids = vocab_parallel_argmax(logits[0], self.module.vocab_offset)
        return self.target_ids[draft_ids]

    def extend(self, aux: Tensor, next_tokens: Tensor):
        """Real positions: aux [s, b, n_aux*h] captured by the base, next_tokens [b, s]."""
        self._step(self.module.project(aux), next_tokens)
        self.length += aux.shape[0]

    def start(self, prompt: Tensor, pending: Tensor, out, max_length: int):
        """After the base prefill: prompt [b, P], pending [b, 1] (the base's next token)."""
        self.kv = [[] for _ in self.module.layers]
        self.length = 0
        self._rope = self.rotary(max_length)
        self.extend(out.aux, torch.cat([prompt[:, 1:], pending], dim=1))

    def _chain(self, k: int, policy, pick):
        """Up to k chained drafts after the newest real position (draft_policy.draft_chain;
        take() gives target ids [b]). Returns the ids and the extras; leaves the drafter as
        it found it (the chain's cache entries and states are dropped)."""
        real = self._last

        def advance(ids):
            self._step(self._last[0], ids[:, None])
            return self._last[1]

        drafts, extras = draft_chain(k, policy, real[1], advance, pick)
        self._truncate(self.length)
        self._last = real
        return drafts, extras

    def propose(self, k: int, policy=None) -> Tensor:
        """Up to k greedy chained draft tokens [b, n] (target ids; n may be 0)."""
        size = self.module.draft_vocab_size
        confident = policy is not None and policy.threshold is not None

        def pick(logits):
            confidence = (float(vocab_parallel_log_probs(logits, size).max().exp())
                          if confident else 1.0)  # the softmax only when the policy reads it
            return confidence, lambda: (self._argmax(logits), None)

        drafts, _ = self._chain(k, policy, pick)
        if not drafts:
            return self.target_ids.new_zeros(self._last[1].shape[1], 0)
        return torch.stack(drafts, dim=1)

    def propose_sampled(self, k: int, policy, sampling, rng):
        """Up to k chained tokens sampled from the draft's own distribution (temperature,
        top-k, top-p over the draft vocabulary) and those distributions over the target
        vocabulary, ([b, n], [b, n, V] float64), for lossless verification with draft
        probabilities. The chain stops as `propose`'s does (top probability as confidence)."""
        from megatron_specdec.acceptance.reference import target_probs

        vocab = self.module.t2d.numel()

        def pick(logits):
            q = target_probs(vocab_parallel_gather(logits, self.module.draft_vocab_size),
                             sampling.temperature, sampling.top_k, sampling.top_p)

            def take():
                full = q.new_zeros(q.shape[0], vocab)
                full[:, self.target_ids] = q
                return self.target_ids[torch.multinomial(q, 1, generator=rng)[:, 0]], full

            return float(q.max()), take

        drafts, probs = self._chain(k, policy, pick)
        if not drafts:
            return self.target_ids.new_zeros(self._last[1].shape[1], 0), None
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1)

    def propose_tree(self, depth: int, spec: TreeSpec,
                     floor: float = float("-inf")) -> DraftTree:
        """A draft tree (target ids) of at most `depth` levels after the newest real position,
        grown as tree.py describes (`floor`: the cumulative log-prob a node needs). Leaves the
        drafter as it found it, like `propose`."""
        real_hidden, real_logits = self._last
        size = self.module.draft_vocab_size
        outputs = {}  # expanded candidate -> its output hidden state [1, b, h]
        expanded = []  # expanded candidates in cache order: slots length, length + 1, ...

        def expand(candidates: DraftTree, frontier: Tensor, d: int) -> Tensor:
            parents = candidates.parents[frontier].tolist()
            hidden = torch.cat([real_hidden if p < 0 else outputs[p] for p in parents])
            tokens = self.target_ids[candidates.tokens[frontier]][None]
            expanded.extend(frontier.tolist())
            seen = ancestors(candidates.parents)[frontier][:, expanded]
            mask = torch.cat([seen.new_zeros(len(parents), self.length), ~seen], dim=1)
            positions = torch.full((len(parents),), self.length - 1 + d, device=hidden.device)
            out, logits = self._forward(hidden, tokens, positions, mask[None, None])
            outputs.update((c, out[i:i + 1]) for i, c in enumerate(frontier.tolist()))
            return vocab_parallel_log_probs(logits, size)

        tree = grow_tree(vocab_parallel_log_probs(real_logits, size)[0], expand, depth, spec,
                         floor)
        self._truncate(self.length)
        return DraftTree(self.target_ids[tree.tokens], tree.parents)

    def accept(self, num_accepted: int, new_tokens: Tensor, out):
        """The base verified pending and its drafts and kept pending plus `num_accepted`
        drafts, whose states are rows 0..num_accepted of `out`; new_tokens
        [b, num_accepted + 1] are the accepted drafts and the base's next token."""
        self.extend(out.aux[: num_accepted + 1], new_tokens)

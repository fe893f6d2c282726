"""EAGLE3 chain drafting over the draft module's own KV cache (last pipeline stage).

Indexing follows training (spec_model / eagle3_module): the draft at position t reads
fc(aux_t) and the embedding of token t+1, and predicts token t+2. The cache holds one entry
per *real* position (base states known); a chain step j (position t+j) reads the previous
step's output hidden state and the embedding of the token it just drafted, and attends to
all real entries plus the chain so far, exactly the keys its training-time-test step sees.
Chain entries are dropped after drafting; once the base has verified, the accepted positions
are re-fed with their real aux states. The cache is a layers.decode_attention.DecodeCache
with a length per row (rows of a batch keep different counts; a ragged chunk is left-padded,
its padding placed past the row's length); slot index = position, so one causal mask serves
both.

A parallel-drafting (P-EAGLE) draft proposes the whole chain in the forward that reads the
real positions: after each row's newest real position it appends ttt_steps - 1 mask positions
(the mask token's embedding and fc(mask_hidden), causal, as vLLM's parallel drafting lays them
out), keeps the logits of the newest real position and the mask positions, and drops the mask
entries from the cache. A chain step then costs nothing but reading the next position's
logits.

A tree (tree.py) is drafted the same way, one draft forward per depth over the expanded
frontier: a node at depth d runs at position t+d on its parent's output hidden state and
its own token's embedding, attending to the real entries and the entries of its ancestors,
so every root-to-node path sees exactly what the chain along it would.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron_specdec.inference.draft_policy import draft_chain
from megatron_specdec.inference.tree import DraftTree, TreeSpec, ancestors, grow_tree, sample_tree
from megatron_specdec.models.layers.decode_embedding import decode_embedding
from megatron_specdec.models.layers.vocab_parallel import (
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
        self.cache = None  # DecodeCache of the draft layers
        self.kv = []  # each draft layer's view of the cache
        self.real = None  # [b] real positions per row (the rest: the current chain)
        self._rope: Optional[Tensor] = None
        # (hidden [1, b, h], logits [1 + masks, b, Dp/TP]) of each row's newest position (and,
        # drafting in parallel, of the mask positions after it)
        self._last = None
        cfg = model.spec_config
        self.masks = cfg.ttt_steps - 1 if cfg.parallel_drafting else 0
        self.mask_token_id = cfg.mask_token_id
        self._mask_hidden = None  # fc(mask_hidden) [1, 1, h], taken once a generation

    def _forward(self, hidden: Tensor, next_tokens: Tensor, positions=None, mask=None,
                 counts=None, last: int = 0):
        """Append s cache entries per row: hidden [s, b, h], next_tokens [b, s]; by default
        at RoPE position = slot, causal (`counts`: a left-padded chunk, DecodeCache.place);
        a tree passes positions [s] and mask [1, 1, s, cached + s]. Returns (hidden out
        [s, b, h], logits [s (or `last`), b, Dp/TP])."""
        slots = self.cache.place(hidden.shape[0], hidden.device, counts)
        positions = slots if positions is None else positions.expand_as(slots)
        if mask is None:
            mask = self.cache.causal_mask(slots)
        embeds = decode_embedding(self.embedding, next_tokens)
        rotary = self._rope[positions.T][:, :, 0]
        if self.module.lean and not torch.is_grad_enabled():
            self.cache.set_rotary(rotary)
            out = self.module.decode_step(embeds, hidden, mask, self.cache, last)
        else:
            out = self.module.step(embeds, hidden, rotary, mask, self.kv, last)
        self.cache.commit()
        return out

    def _blocks(self) -> list:
        """Each draft layer's view of the cache, keyed by its layer number as its decoding
        path keys it."""
        return [self.cache.blocks(layer.self_attention.layer_number)
                for layer in self.module.layers]

    def _step(self, hidden: Tensor, next_tokens: Tensor, counts=None):
        """Append hidden [s, b, h], next_tokens [b, s] after each row's cached entries and
        keep the newest state of each row."""
        hidden, logits = self._forward(hidden, next_tokens, counts=counts, last=1)
        self._last = (hidden[-1:], logits)

    def _block(self, hidden: Tensor, next_tokens: Tensor, counts=None):
        """`_step`, then the mask positions after each row's newest, in one forward; their
        cache entries are dropped and their logits kept in `_last`."""
        n, b = self.masks, hidden.shape[1]
        tokens = torch.cat([next_tokens, next_tokens.new_full((b, n), self.mask_token_id)], 1)
        hidden = torch.cat([hidden, self._mask_hidden.to(hidden.dtype).expand(n, b, -1)])
        hidden, logits = self._forward(hidden, tokens, counts=None if counts is None
                                       else counts + n, last=n + 1)
        self.cache.lengths.sub_(n)
        self._last = (hidden[-n - 1:-n], logits)

    def _drop_chain(self):
        self.cache.lengths.copy_(self.real)

    def _argmax(self, logits: Tensor) -> Tensor:
        """Target ids [b] of the draft's top token (logits [1, b, Dp/TP], vocab-parallel)."""
        draft_ids = vocab_parallel_argmax(logits[0], self.module.vocab_offset)
        return self.target_ids[draft_ids]

    def _log_probs(self, logits: Tensor) -> Tensor:
        """Log-probs [b, D] over the draft vocabulary of logits [1, b, Dp/TP]."""
        return vocab_parallel_log_probs(logits.transpose(0, 1), self.module.draft_vocab_size)

    def extend(self, aux: Tensor, next_tokens: Tensor, counts: Tensor):
        """Real positions: aux [s, b, n_aux*h] captured by the base, next_tokens [b, s]; the
        last counts[b] of row b are real. One row runs its real positions alone, as a chain
        (the decoding path's one-op attention), not a left-padded chunk."""
        if next_tokens.shape[0] == 1:
            real = int(counts[0])
            aux, next_tokens, counts = aux[aux.shape[0] - real:], next_tokens[:, -real:], None
        hidden = self.module.project(aux)
        if self.masks:
            self._block(hidden, next_tokens, counts)
        else:
            self._step(hidden, next_tokens, counts)
        self.real = self.cache.lengths.clone()

    def start(self, prompt: Tensor, lengths: Tensor, pending: Tensor, out, max_length: int):
        """After the base prefill: prompt [b, P] left-padded to rows of `lengths`, pending
        [b, 1] (the base's next token)."""
        from megatron_specdec.models.layers.decode_attention import DecodeCache

        self.cache = DecodeCache(prompt.shape[0], max_length)
        self.kv = self._blocks()
        self._rope = self.rotary(max_length)
        if self.masks:
            self._mask_hidden = self.module.mask_input(1, 1)[1]
        self.extend(out.aux, torch.cat([prompt[:, 1:], pending], dim=1), lengths)

    def _chain(self, k: int, policy, pick):
        """Up to k chained drafts after each row's newest real position
        (draft_policy.draft_chain; take() gives target ids [b]). Leaves the drafter as it
        found it (the chain's cache entries and states are dropped). Drafting in parallel,
        step i reads the logits of mask position i, which the last real forward computed."""
        real = self._last
        if self.masks:
            ahead = iter(real[1][1:].split(1))
            return draft_chain(k, policy, real[1][:1], lambda ids: next(ahead), pick)

        def advance(ids):
            self._step(self._last[0], ids[:, None])
            return self._last[1]

        drafts, extras, counts = draft_chain(k, policy, real[1], advance, pick)
        self._drop_chain()
        self._last = real
        return drafts, extras, counts

    def _stack(self, drafts):
        return (torch.stack(drafts, dim=1) if drafts
                else self.target_ids.new_zeros(self._last[1].shape[1], 0))

    def propose(self, k: int, policy=None):
        """Up to k greedy chained draft tokens [b, n] (target ids; n may be 0) and the
        count [b] each row keeps."""
        confident = policy is not None and policy.threshold is not None

        def pick(logits):
            # The softmax only when the policy reads it.
            confidence = (self._log_probs(logits).max(-1).values.double().exp() if confident
                          else logits.new_ones(logits.shape[1], dtype=torch.float64))
            return confidence, lambda: (self._argmax(logits), None)

        drafts, _, counts = self._chain(k, policy, pick)
        return self._stack(drafts), counts

    def propose_sampled(self, k: int, policy, sampling, rng):
        """Up to k chained tokens sampled from the draft's own distribution (temperature,
        top-k, top-p over the draft vocabulary), the counts kept, and those distributions
        over the target vocabulary, ([b, n], [b], [b, n, V] float64), for lossless
        verification with draft probabilities. The chain stops as `propose`'s does (top
        probability as confidence)."""
        from megatron_specdec.acceptance.reference import target_probs

        vocab = self.module.t2d.numel()

        def pick(logits):
            q = target_probs(vocab_parallel_gather(logits.transpose(0, 1),
                                                   self.module.draft_vocab_size),
                             sampling.temperature, sampling.top_k, sampling.top_p)

            def take():
                full = q.new_zeros(q.shape[0], vocab)
                full[:, self.target_ids] = q
                return self.target_ids[torch.multinomial(q, 1, generator=rng)[:, 0]], full

            return q.max(-1).values.double(), take

        drafts, probs, counts = self._chain(k, policy, pick)
        return self._stack(drafts), counts, torch.stack(probs, dim=1) if probs else None

    def _tree(self, grow, row: int):
        """grow(root, expand) over the draft's logits for batch row `row`, through a batch-1
        view of its cache (one row's tree at a time): root [D] after the row's newest real
        position, expand(candidates, frontier, d) runs the draft over the frontier nodes
        (indices into `candidates`, a DraftTree in draft ids, all at depth d) and returns
        their logits [len(frontier), D]. Returns what grow returns; leaves the drafter as it
        found it, like `propose`."""
        if self.masks:
            raise ValueError("a parallel-drafting EAGLE3 draft drafts a chain in one forward; "
                             "it has no tree (drop tree / --tree)")
        whole = self.cache, self.kv, self._last, self.real
        self.cache = self.cache.row(row)
        self.kv = self._blocks()
        self._last = tuple(x[:, row: row + 1] for x in self._last)
        self.real = self.real[row: row + 1]
        try:
            return self._row_tree(grow)
        finally:
            self.cache, self.kv, self._last, self.real = whole

    def _row_tree(self, grow):
        """`_tree` on a batch-1 drafter."""
        real_hidden, real_logits = self._last
        size = self.module.draft_vocab_size
        length = int(self.real[0])
        outputs = {}  # expanded candidate -> its output hidden state [1, b, h]
        expanded = []  # expanded candidates in cache order: slots length, length + 1, ...

        def expand(candidates: DraftTree, frontier: Tensor, d: int) -> Tensor:
            parents = candidates.parents[frontier].tolist()
            hidden = torch.cat([real_hidden if p < 0 else outputs[p] for p in parents])
            tokens = self.target_ids[candidates.tokens[frontier]][None]
            expanded.extend(frontier.tolist())
            seen = ancestors(candidates.parents)[frontier][:, expanded]
            mask = torch.cat([seen.new_zeros(len(parents), length), ~seen], dim=1)
            positions = torch.full((len(parents),), length - 1 + d, device=hidden.device)
            out, logits = self._forward(hidden, tokens, positions, mask[None, None])
            outputs.update((c, out[i:i + 1]) for i, c in enumerate(frontier.tolist()))
            return vocab_parallel_gather(logits, size)

        grown = grow(vocab_parallel_gather(real_logits, size)[0], expand)
        self._drop_chain()
        return grown

    def propose_tree(self, depth: int, spec: TreeSpec, floor: float = float("-inf"),
                     row: int = 0) -> DraftTree:
        """Batch row `row`'s draft tree (target ids) of at most `depth` levels after its newest
        real position, grown as tree.py describes (`floor`: the cumulative log-prob a node
        needs)."""
        def log_probs(logits):
            return logits.float().log_softmax(-1)

        tree = self._tree(lambda root, expand: grow_tree(
            log_probs(root), lambda *at: log_probs(expand(*at)), depth, spec, floor), row)
        return DraftTree(self.target_ids[tree.tokens], tree.parents)

    def propose_tree_sampled(self, depth: int, spec: TreeSpec, floor: float, sampling, rng,
                             row: int = 0):
        """Row `row`'s tree sampled from the draft's own distribution (temperature, top-k,
        top-p over the draft vocabulary; tree.sample_tree), in target ids, and the
        distribution each node was drawn from over the target vocabulary [N, V] float64, for
        lossless tree verification with draft probabilities."""
        from megatron_specdec.acceptance.reference import target_probs

        def q(logits):
            return target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)

        tree, probs = self._tree(lambda root, expand: sample_tree(
            q(root), lambda *at: q(expand(*at)), depth, spec, rng, floor), row)
        full = probs.new_zeros(probs.shape[0], self.module.t2d.numel())
        full[:, self.target_ids] = probs
        return DraftTree(self.target_ids[tree.tokens], tree.parents), full

    def keep_rows(self, rows: Tensor):
        """Keep only the batch rows `rows` (ascending; finished rows leave the batch)."""
        self.cache.keep_rows(rows)
        self.kv = self._blocks()
        self.real = self.real[rows.cpu()]
        self._last = tuple(x.index_select(1, rows.to(x.device)) for x in self._last)

    def accept(self, tokens: Tensor, counts: Tensor, out):
        """The base kept tokens [b, s] (the last counts[b] of row b; each real token is the
        one after its position), whose states are `out`'s."""
        self.extend(out.aux, tokens, counts)


def make_proposer(model, options):
    """This stage's EAGLE3 proposer (None before the last stage). Collective over the
    pipeline: the last stage gets a replica of the base's embedding."""
    from megatron.core import parallel_state as ps

    from megatron_specdec.inference.embedding import last_stage_embedding

    embedding = last_stage_embedding(model)
    return Eagle3Drafter(model, embedding) if ps.is_pipeline_last_stage() else None

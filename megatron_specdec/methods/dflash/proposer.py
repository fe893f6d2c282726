"""DFlash drafting: k tokens from one draft forward (last pipeline stage).

The draft's cache (a DecodeCache, slot = position) holds, for every layer, the context keys
and values of each row's real positions: the base's aux states there through fc,
hidden_norm and the layer's k/v projection, as in training. A proposal places the block
[pending token, mask x k] at the row's next k+1 slots, attends to the real slots and the
whole block (bidirectional), and drops the block's entries again. Block position i's logits
are draft i; `draft_chain` walks them in order, so a confidence policy cuts the block where
the product of top probabilities drops (adaptive block length), and sampling draws each
position from the draft's own distribution for lossless verification. A tree takes each
block position's top-k (or samples) as the children of every node at that depth. Accepted
tokens' base states are appended as context once the base has verified them.
"""

import torch
from torch import Tensor

from megatron_specdec.inference.draft_policy import draft_chain
from megatron_specdec.methods.dflash.model import draft_logits, output_weight
from megatron_specdec.models.layers.decode_embedding import decode_embedding
from megatron_specdec.models.layers.greedy_head import output_argmax, output_argmax_confidence
from megatron_specdec.models.layers.vocab_parallel import (
    vocab_parallel_argmax,
    vocab_parallel_gather,
    vocab_parallel_log_probs,
)


class DFlashDrafter:
    def __init__(self, model, embedding):
        """model: the last stage of a base + DFlash model; embedding: the base's token
        embedding on this stage (inference.embedding.last_stage_embedding)."""
        from megatron.core import parallel_state as ps

        self.model = model
        self.module = model.draft
        self.embedding = embedding
        self.block_size = model.spec_config.block_size
        self.vocab_size = model.vocab_size
        self.cache = None
        self.pending = None  # [b] each row's newest token, whose base state is not known yet
        self._rope = None
        self._tp_rank = ps.get_tensor_model_parallel_rank()

    def _rotary(self, slots: Tensor) -> Tensor:
        return self._rope[slots.T].reshape(slots.shape[1], slots.shape[0], 1, -1)

    def extend(self, aux: Tensor, counts: Tensor):
        """Real positions: aux [s, b, n_aux*h] captured by the base (the last counts[b] of
        row b are real)."""
        slots = self.cache.place(aux.shape[0], aux.device, counts)
        self.module.cache_context(self.module.context(aux), self._rotary(slots), self.cache)
        self.cache.commit()

    def start(self, prompt: Tensor, lengths: Tensor, pending: Tensor, out, max_length: int):
        from megatron_specdec.models.layers.decode_attention import DecodeCache

        self.cache = DecodeCache(prompt.shape[0], max_length + self.block_size)
        self._rope = self.model.rotary_pos_emb(max_length + self.block_size)
        self.extend(out.aux, lengths)
        self.pending = pending[:, 0].clone()

    def _block_hidden(self, k: int) -> Tensor:
        """The draft's final hidden states of block positions 1..k, [k, b, h] (the cache is
        left as it was)."""
        b = self.pending.shape[0]
        slots = self.cache.place(k + 1, self.pending.device)
        embeds = self.module.block_inputs(
            decode_embedding(self.embedding, self.pending[:, None]), k + 1)
        ends = (self.cache.lengths + k + 1).to(slots.device)
        keys = torch.arange(int(ends.max()), device=slots.device)
        mask = (keys[None, :] >= ends[:, None])[:, None, None].expand(b, 1, k + 1, -1)
        hidden = self.module.decode(embeds, self._rotary(slots), mask, self.cache)
        # no commit: the block's slots stay beyond each row's length and are overwritten later
        return hidden[1:]

    def block_logits(self, k: int) -> Tensor:
        """This rank's vocabulary slice of the logits of block positions 1..k, [k, b, V/TP]."""
        return draft_logits(self.model, self._block_hidden(k))

    def _chain(self, per_position: Tensor, k: int, policy, pick):
        """draft_chain over the block's per-position logits (or ids) [k, b, ...]."""
        steps = iter(range(1, k))
        return draft_chain(k, policy, per_position[0:1],
                           lambda _: per_position[next(steps)][None], pick)

    def _stack(self, drafts):
        return (torch.stack(drafts, dim=1) if drafts
                else self.pending.new_zeros(self.pending.shape[0], 0))

    def _offset_of(self, logits):
        return self._tp_rank * logits.shape[-1]

    def propose(self, k: int, policy=None):
        """Up to k greedy drafts [b, n] from one draft forward, and the count [b] each row
        keeps (a confidence policy cuts each row's block). Each position's argmax, and for a
        confidence policy its probability, come from the screened greedy head where it runs
        (models/layers/greedy_head.py: a quarter of the output layer's bytes, no float32
        logits; the probability's normaliser from the screened logits)."""
        confident = policy is not None and policy.threshold is not None
        hidden = self._block_hidden(k)
        rows = (hidden.reshape(-1, hidden.shape[-1]), output_weight(self.model), self.vocab_size,
                self.model.base.tp_group)
        found = output_argmax_confidence(*rows) if confident else output_argmax(*rows)
        if found is not None:
            ids, top = found if confident else (found, torch.ones_like(found, dtype=torch.float64))
            per_position = torch.stack([ids.double(), top], -1).view(k, -1, 2)

            def take(position):  # [1, b, (id, probability)]
                return position[0, :, 1], lambda: (position[0, :, 0].long(), None)

            drafts, _, counts = self._chain(per_position, k, policy, take)
            return self._stack(drafts), counts

        def pick(logits):
            confidence = (vocab_parallel_log_probs(logits.transpose(0, 1), self.vocab_size)
                          .max(-1).values.double().exp() if confident
                          else logits.new_ones(logits.shape[1], dtype=torch.float64))
            return confidence, lambda: (vocab_parallel_argmax(logits[0], self._offset_of(logits)), None)

        drafts, _, counts = self._chain(draft_logits(self.model, hidden), k, policy, pick)
        return self._stack(drafts), counts

    def propose_sampled(self, k: int, policy, sampling, rng):
        """Up to k drafts sampled from the draft's own distribution (temperature, top-k,
        top-p), the counts kept, and those distributions ([b, n], [b], [b, n, V] float64)."""
        from megatron_specdec.acceptance.reference import target_probs

        def pick(logits):
            q = target_probs(vocab_parallel_gather(logits.transpose(0, 1), self.vocab_size),
                             sampling.temperature, sampling.top_k, sampling.top_p)
            return q.max(-1).values.double(), lambda: (
                torch.multinomial(q, 1, generator=rng)[:, 0], q)

        drafts, probs, counts = self._chain(self.block_logits(k), k, policy, pick)
        return self._stack(drafts), counts, torch.stack(probs, dim=1) if probs else None

    def _row_block(self, depth: int, row: int) -> Tensor:
        """Row `row`'s full-vocabulary logits [depth, V] of block positions 1..depth."""
        return vocab_parallel_gather(self.block_logits(depth)[:, row:row + 1], self.vocab_size)

    def propose_tree(self, depth: int, spec, floor: float = float("-inf"), row: int = 0):
        """Row `row`'s draft tree from the block's per-position top-k (tree.grow_tree): block
        positions do not see each other's tokens, so every node at depth d has position d's
        distribution, and one draft forward drafts the whole tree."""
        from megatron_specdec.inference.tree import grow_tree

        log_probs = self._row_block(depth, row).float().log_softmax(-1)
        return grow_tree(log_probs[0], lambda tree, frontier, d: log_probs[d].expand(
            frontier.numel(), -1), depth, spec, floor)

    def propose_tree_sampled(self, depth: int, spec, floor: float, sampling, rng, row: int = 0):
        """Row `row`'s tree sampled from the block's distributions (tree.sample_tree) and the
        distribution each node was drawn from [N, V], for lossless tree verification."""
        from megatron_specdec.acceptance.reference import target_probs
        from megatron_specdec.inference.tree import sample_tree

        q = target_probs(self._row_block(depth, row), sampling.temperature, sampling.top_k,
                         sampling.top_p)
        return sample_tree(q[0], lambda tree, frontier, d: q[d].expand(frontier.numel(), -1),
                           depth, spec, rng, floor)

    def accept(self, tokens: Tensor, counts: Tensor, out):
        """The base kept tokens [b, s] (the last counts[b] of row b; each is the token after
        its position, whose state `out` holds): their states become context, the newest
        token the next block's first."""
        self.extend(out.aux, counts)
        kept = counts.to(tokens.device) > 0
        self.pending = torch.where(kept, tokens[:, -1], self.pending)

    def keep_rows(self, rows: Tensor):
        self.cache.keep_rows(rows)
        self.pending = self.pending[rows.to(self.pending.device)]


def make_proposer(model, options):
    """This stage's DFlash proposer (None before the last stage). Collective over the
    pipeline: the last stage gets a replica of the base's embedding."""
    from megatron.core import parallel_state as ps

    from megatron_specdec.inference.embedding import last_stage_embedding

    embedding = last_stage_embedding(model)
    return DFlashDrafter(model, embedding) if ps.is_pipeline_last_stage() else None

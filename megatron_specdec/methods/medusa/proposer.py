"""Medusa drafting: the heads read the base's final hidden state at the newest verified
position t; head i proposes token t+2+i (the base's own logits there give token t+1, the
pending token). No draft cache: every proposal comes from one base state.

A tree (tree.py) takes head d's top-k as the children of each expanded depth-d node: the
heads do not see the drafted tokens, so every node of a depth gets the same candidates, and
the cumulative log-prob picks which branches grow and which nodes stay. This is the dynamic
counterpart of Medusa's static `medusa_choices` tree (top-i of head d along each path)."""

import torch
from torch import Tensor

from megatron_specdec.inference.draft_policy import draft_chain
from megatron_specdec.inference.tree import DraftTree, TreeSpec, grow_tree
from megatron_specdec.models.layers.vocab_parallel import (
    vocab_parallel_argmax,
    vocab_parallel_log_probs,
)


class MedusaDrafter:
    def __init__(self, model):
        self.heads = model.draft
        self.vocab_size = model.vocab_size
        self._hidden = None  # [1, b, h]

    def start(self, prompt: Tensor, lengths: Tensor, pending: Tensor, out, max_length: int):
        self._hidden = out.hidden[-1:]

    def propose(self, k: int, policy=None):
        """Up to k tokens [b, n], head i's top token at position i, and the count [b] each
        row keeps: a DraftPolicy with a threshold keeps a row's heads while the product of
        their top probabilities stays above it (draft_policy.draft_chain)."""
        heads = iter(self.heads(self._hidden)[:k])
        confident = policy is not None and policy.threshold is not None

        def pick(logits):
            confidence = (vocab_parallel_log_probs(logits.transpose(0, 1), self.vocab_size)
                          .max(-1).values.double().exp() if confident
                          else logits.new_ones(logits.shape[1], dtype=torch.float64))
            return confidence, lambda: (vocab_parallel_argmax(logits[0], self.heads.vocab_offset),
                                        None)

        drafts, _, counts = draft_chain(k, policy, next(heads), lambda _: next(heads), pick)
        if not drafts:
            return torch.zeros(self._hidden.shape[1], 0, dtype=torch.long,
                               device=self._hidden.device), counts
        return torch.stack(drafts, dim=1), counts

    def propose_tree(self, depth: int, spec: TreeSpec, floor: float = float("-inf"),
                     row: int = 0) -> DraftTree:
        """Batch row `row`'s tree: head d's top-k under every depth-d node; `floor`: see
        tree.grow_tree."""
        heads = [vocab_parallel_log_probs(logits, self.vocab_size)
                 for logits in self.heads(self._hidden[:, row: row + 1])[:depth]]
        return grow_tree(heads[0][0], lambda _, frontier, d: heads[d].expand(len(frontier), -1),
                         depth, spec, floor)

    def keep_rows(self, rows: Tensor):
        self._hidden = self._hidden.index_select(1, rows.to(self._hidden.device))

    def accept(self, tokens: Tensor, counts: Tensor, out):
        self._hidden = out.hidden[-1:]  # each row's newest kept state (left-padded chunk)


def make_proposer(model, options):
    """This stage's Medusa proposer (None before the last stage)."""
    from megatron.core import parallel_state as ps

    return MedusaDrafter(model) if ps.is_pipeline_last_stage() else None


def check_num_draft_tokens(cfg, k: int):
    if k > cfg.medusa_num_heads:
        raise ValueError(f"num_draft_tokens {k} exceeds the {cfg.medusa_num_heads} Medusa heads")

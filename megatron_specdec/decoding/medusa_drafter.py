"""Medusa drafting: the heads read the base's final hidden state at the newest verified
position t; head i proposes token t+2+i (the base's own logits there give token t+1, the
pending token). No draft cache: every proposal comes from one base state.

A tree (tree.py) takes head d's top-k as the children of each expanded depth-d node: the
heads do not see the drafted tokens, so every node of a depth gets the same candidates, and
the cumulative log-prob picks which branches grow and which nodes stay. This is the dynamic
counterpart of Medusa's static `medusa_choices` tree (top-i of head d along each path)."""

import torch
from torch import Tensor

from megatron_specdec.decoding.tree import (
    DraftTree,
    TreeSpec,
    grow_tree,
)
from megatron_specdec.layers.vocab_parallel import (
    vocab_parallel_argmax,
    vocab_parallel_log_probs,
)


class MedusaDrafter:
    def __init__(self, model):
        self.heads = model.draft
        self.vocab_size = model.vocab_size
        self._hidden = None  # [1, b, h]

    def start(self, prompt: Tensor, pending: Tensor, out, max_length: int):
        self._hidden = out.hidden[-1:]

    def propose(self, k: int, policy=None) -> Tensor:
        """Up to k tokens [b, n], head i's top token at position i; a DraftPolicy with a
        threshold keeps the heads while the product of their top probabilities stays above it."""
        logits = self.heads(self._hidden)[:k]
        if policy is not None and policy.threshold is not None:
            chain, kept = 1.0, 0
            for head in logits:
                chain *= float(vocab_parallel_log_probs(head, self.vocab_size).max().exp())
                if not policy.keeps(chain):
                    break
                kept += 1
            logits = logits[:kept]
        if not logits:
            return torch.zeros(self._hidden.shape[1], 0, dtype=torch.long,
                               device=self._hidden.device)
        return torch.stack([vocab_parallel_argmax(l[0], self.heads.vocab_offset) for l in logits],
                           dim=1)

    def propose_tree(self, depth: int, spec: TreeSpec,
                     floor: float = float("-inf")) -> DraftTree:
        """Head d's top-k under every depth-d node; `floor`: see tree.grow_tree."""
        heads = [vocab_parallel_log_probs(logits, self.vocab_size)
                 for logits in self.heads(self._hidden)[:depth]]
        return grow_tree(heads[0][0], lambda _, frontier, d: heads[d].expand(len(frontier), -1),
                         depth, spec, floor)

    def accept(self, num_accepted: int, new_tokens: Tensor, out):
        self._hidden = out.hidden[num_accepted: num_accepted + 1]

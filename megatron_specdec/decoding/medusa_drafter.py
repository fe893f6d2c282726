"""Medusa drafting: the heads read the base's final hidden state at the newest verified
position t; head i proposes token t+2+i (the base's own logits there give token t+1, the
pending token). No draft cache: every proposal comes from one base state."""

import torch
from torch import Tensor

from megatron_specdec.layers.losses import vocab_parallel_argmax


class MedusaDrafter:
    def __init__(self, model):
        self.heads = model.draft
        self._hidden = None  # [1, b, h]

    def start(self, prompt: Tensor, pending: Tensor, out, max_length: int):
        self._hidden = out.hidden[-1:]

    def propose(self, k: int) -> Tensor:
        logits = self.heads(self._hidden)[:k]
        return torch.stack([vocab_parallel_argmax(l[0], self.heads.vocab_offset) for l in logits],
                           dim=1)

    def accept(self, num_accepted: int, new_tokens: Tensor, out):
        self._hidden = out.hidden[num_accepted: num_accepted + 1]

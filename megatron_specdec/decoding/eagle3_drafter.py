"""EAGLE3 chain drafting over the draft module's own KV cache (last pipeline stage).

Indexing follows training (spec_model / eagle3_module): the draft at position t reads
fc(aux_t) and the embedding of token t+1, and predicts token t+2. The cache holds one entry
per *real* position (base states known); a chain step j (position t+j) reads the previous
step's output hidden state and the embedding of the token it just drafted, and attends to
all real entries plus the chain so far, exactly the keys its training-time-test step sees.
Chain entries are dropped after drafting; once the base has verified, the accepted positions
are re-fed with their real aux states. Slot index = position, so one causal mask serves both.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron_specdec.layers.losses import vocab_parallel_argmax


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

    def _step(self, hidden: Tensor, next_tokens: Tensor):
        """Append positions [cached, cached + s): hidden [s, b, h], next_tokens [b, s]."""
        s = hidden.shape[0]
        start = self._cached()
        q = torch.arange(start, start + s, device=hidden.device)[:, None]
        keys = torch.arange(start + s, device=hidden.device)[None, :]
        mask = (keys > q)[None, None]
        embeds = self.embedding(input_ids=next_tokens, position_ids=None)
        hidden, logits = self.module.step(embeds, hidden, self._rope[start:start + s], mask,
                                          self.kv)
        self._last = (hidden[-1:], logits[-1:])

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

    def propose(self, k: int) -> Tensor:
        """k chained draft tokens [b, k] (target ids) after the newest real position. Leaves
        the drafter as it found it (the chain's cache entries and states are dropped)."""
        real = self._last
        hidden, logits = real
        drafts = [self._argmax(logits)]
        for _ in range(k - 1):
            self._step(hidden, drafts[-1][:, None])
            hidden, logits = self._last
            drafts.append(self._argmax(logits))
        self._truncate(self.length)
        self._last = real
        return torch.stack(drafts, dim=1)

    def accept(self, num_accepted: int, new_tokens: Tensor, out):
        """The base verified [pending, d_1..d_k] and kept pending plus `num_accepted` drafts;
        new_tokens [b, num_accepted + 1] are the accepted drafts and the base's next token."""
        self.extend(out.aux[: num_accepted + 1], new_tokens)

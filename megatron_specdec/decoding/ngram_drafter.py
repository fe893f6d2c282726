"""Prompt-lookup (n-gram) drafting: no draft model. The tokens that followed the most recent
earlier occurrence of the context's last n tokens (longest n first) are proposed, as
transformers' `prompt_lookup_num_tokens` and vLLM's `ngram` method do. Runs on the last
pipeline stage like every drafter; needs nothing from the base but the emitted tokens.

An n-gram has no probabilities, so under an adaptive DraftPolicy its confidence in draft
position j is the running rate at which position j was accepted when proposed (starting at
PRIOR and drifting back to it while unused, so a drafter that stopped proposing tries again).
"""

import torch
from torch import Tensor

PRIOR = 0.5
DECAY = 0.9  # weight of the past in the running acceptance rates


class NgramDrafter:
    free_to_probe = True  # proposing costs a search of the history: no backoff needed

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got "
                             f"min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history = torch.zeros(0, dtype=torch.long)
        self.rates = []  # running P(position j accepted | j - 1 accepted), j = 1, 2, ...
        self.proposed = 0

    def start(self, prompt: Tensor, pending: Tensor, out, max_length: int):
        self.history = torch.cat([prompt[0], pending[0]]).cpu()
        self.proposed = 0

    def _lookup(self, k: int) -> Tensor:
        history = self.history
        for n in range(min(self.max_ngram, history.numel() - 1), self.min_ngram - 1, -1):
            windows = history[:-1].unfold(0, n, 1)  # every earlier n-gram (not the suffix)
            hits = (windows == history[-n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return history[start: start + k]
        return history[:0]

    def propose(self, k: int, policy=None) -> Tensor:
        """Up to k tokens [1, n] (n may be 0 when no n-gram recurs, or, under an adaptive
        policy, when recent proposals were rejected)."""
        found = self._lookup(k)
        self.rates += [PRIOR] * (k - len(self.rates))
        keep, chain = 0, 1.0
        for j in range(found.numel()):
            chain *= self.rates[j]
            if policy is not None and not policy.keeps(chain):
                break
            keep += 1
        self.proposed = keep
        return found[:keep].to(self.history.device)[None]

    def accept(self, num_accepted: int, new_tokens: Tensor, out):
        for j in range(len(self.rates)):
            if j < min(num_accepted + 1, self.proposed):  # position j + 1 was tried
                hit = float(j < num_accepted)
            else:
                hit = PRIOR
            self.rates[j] = DECAY * self.rates[j] + (1 - DECAY) * hit
        self.proposed = 0
        self.history = torch.cat([self.history, new_tokens[0].cpu()])

"""Prompt-lookup (n-gram) drafting: no draft model. The tokens that followed the most recent
earlier occurrence of the context's last n tokens (longest n first) are proposed, as
transformers' `prompt_lookup_num_tokens` and vLLM's `ngram` method do. Runs on the last
pipeline stage like every drafter; needs nothing from the base but the emitted tokens."""

import torch
from torch import Tensor


class NgramDrafter:
    free_to_probe = True  # proposing costs a search of the history: no backoff needed

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got "
                             f"min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history = torch.zeros(0, dtype=torch.long)

    def start(self, prompt: Tensor, pending: Tensor, out, max_length: int):
        self.history = torch.cat([prompt[0], pending[0]]).cpu()

    def propose(self, k: int, policy=None) -> Tensor:
        """Up to k tokens [1, n] (n may be 0 when no n-gram recurs)."""
        history = self.history
        for n in range(min(self.max_ngram, history.numel() - 1), self.min_ngram - 1, -1):
            windows = history[:-1].unfold(0, n, 1)  # every earlier n-gram (not the suffix)
            hits = (windows == history[-n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return history[start: start + k][None]
        return history.new_zeros(1, 0)

    def accept(self, num_accepted: int, new_tokens: Tensor, out):
        self.history = torch.cat([self.history, new_tokens[0].cpu()])

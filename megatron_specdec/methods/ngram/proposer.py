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
        self.history = []  # per row, its tokens so far (host)
        self.rates = torch.zeros(0, 0)  # [b, j]: running P(position j + 1 accepted | j)
        self.proposed = None  # [b] drafts each row proposed last

    def start(self, prompt: Tensor, lengths: Tensor, pending: Tensor, out, max_length: int):
        rows = torch.cat([prompt, pending], dim=1).cpu()
        self.history = [row[row.numel() - n - 1:] for row, n in zip(rows, lengths.tolist())]
        self.rates = torch.full((len(self.history), 0), PRIOR, dtype=torch.float64)
        self.proposed = torch.zeros(len(self.history), dtype=torch.long)

    def _lookup(self, history: Tensor, k: int) -> Tensor:
        for n in range(min(self.max_ngram, history.numel() - 1), self.min_ngram - 1, -1):
            windows = history[:-1].unfold(0, n, 1)  # every earlier n-gram (not the suffix)
            hits = (windows == history[-n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return history[start: start + k]
        return history[:0]

    def propose(self, k: int, policy=None):
        """Up to k tokens per row [b, n] and the count [b] each row keeps (0 when no n-gram
        recurs, or, under an adaptive policy, when recent proposals were rejected)."""
        found = [self._lookup(history, k) for history in self.history]
        batch = len(found)
        grow = max(0, k - self.rates.shape[1])
        self.rates = torch.cat([self.rates, torch.full((batch, grow), PRIOR,
                                                       dtype=torch.float64)], dim=1)
        drafts = torch.zeros(batch, k, dtype=torch.long)
        for row, tokens in enumerate(found):
            drafts[row, : tokens.numel()] = tokens
        within = torch.arange(k) < torch.tensor([t.numel() for t in found])[:, None]
        chain = self.rates[:, :k].cumprod(1)
        keep = within & (True if policy is None else policy.keeps(chain))
        self.proposed = keep.long().cumprod(1).sum(1)
        n = int(self.proposed.max())
        return drafts[:, :n], self.proposed.clone()

    def keep_rows(self, rows: Tensor):
        """Keep only the batch rows `rows` (ascending)."""
        rows = rows.cpu()
        self.history = [self.history[r] for r in rows.tolist()]
        self.rates, self.proposed = self.rates[rows], self.proposed[rows]

    def accept(self, tokens: Tensor, counts: Tensor, out):
        """The kept tokens of one round (the last counts[b] of row b): the accepted drafts
        and the base's next token."""
        counts = counts.cpu()
        accepted = counts - 1
        for j in range(self.rates.shape[1]):  # position j + 1 tried, and accepted?
            tried = j < torch.minimum(counts, self.proposed)
            hit = torch.where(tried, (j < accepted).double(), PRIOR)
            self.rates[:, j] = DECAY * self.rates[:, j] + (1 - DECAY) * hit
        self.proposed = torch.zeros_like(self.proposed)
        tokens = tokens.cpu()
        self.history = [torch.cat([h, row[row.numel() - n:]])
                        for h, row, n in zip(self.history, tokens, counts.tolist())]


def make_proposer(model, options):
    """Prompt lookup on the last stage (None before it): no draft module, any model."""
    from megatron.core import parallel_state as ps

    return NgramDrafter() if ps.is_pipeline_last_stage() else None

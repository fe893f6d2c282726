"""How many tokens to draft in a round.

A round costs one verify forward (a little more than a plain step for each extra row) plus
one draft step per drafted token, and pays only for the drafts the base accepts. With a
confidence threshold the drafter stops as soon as the chance that the whole chain so far is
accepted, estimated by the product of the draft's own top-token probabilities (EAGLE-2's
proxy), falls below it; when even the first token is below it the round drafts nothing and
is a plain decoding step. Drafters without probabilities (n-gram) draft whatever they find.
A draft tree keeps only the nodes whose cumulative probability reaches the threshold.

Drafting nothing still costs the draft model's reading of each new base state and, to
measure its confidence, its lm_head at the newest one (for a full-vocabulary draft about a
sixth of a base step on CPU, where decoding streams the weights). So after a round that
drafted nothing the drafter sits out `backoff` rounds (1, 2, 4, ... up to `max_backoff`,
reset by a round that drafts) and then reads the skipped states in one forward: a draft that
never pays is asked 6 times in 64 tokens and then once every 33 rounds, and one that is
confident in stretches is back within a few tokens.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

POLICIES = ("adaptive", "fixed")
DEFAULT_THRESHOLD = 0.3


@dataclass(frozen=True)
class DraftPolicy:
    max_tokens: int
    threshold: Optional[float] = DEFAULT_THRESHOLD  # None: always draft max_tokens
    max_backoff: int = 32

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.max_tokens}")
        if self.threshold is not None and not 0 <= self.threshold < 1:
            raise ValueError(f"draft threshold must lie in [0, 1), got {self.threshold}")

    def next_backoff(self, backoff: int, drafted: int) -> int:
        """Rounds to sit out after a round that drafted `drafted` tokens following a backoff
        of `backoff` rounds."""
        if self.threshold is None or drafted:
            return 0
        return min(self.max_backoff, 2 * backoff or 1)

    @property
    def tree_floor(self) -> float:
        """The cumulative log-prob a draft tree node needs (tree.grow_tree)."""
        return float("-inf") if not self.threshold else math.log(self.threshold)

    def keeps(self, chain_prob: Tensor) -> Tensor:
        """Per row, whether a draft token whose chain (it and the drafts before it) is
        accepted with probability `chain_prob` [b] is worth drafting and verifying."""
        if self.threshold is None:
            return torch.ones_like(chain_prob, dtype=torch.bool)
        return chain_prob >= self.threshold

    @classmethod
    def named(cls, name: str, max_tokens: int, threshold: float = DEFAULT_THRESHOLD):
        if name not in POLICIES:
            raise ValueError(f"draft policy {name!r}; expected one of {POLICIES}")
        return cls(max_tokens, threshold if name == "adaptive" else None)


def draft_chain(k: int, policy: Optional[DraftPolicy], logits, advance, pick):
    """The chain loop every drafter shares, over a batch: up to k drafts per row from
    `logits` (the draft's output after each row's newest real token). pick(logits) ->
    (confidence [b], take); a row stops once `policy` (None: never) drops the product of
    its confidences, the loop once every row has; otherwise take() -> (tokens [b], extra)
    drafts a token for every row (called only then: a sampler draws nothing for a dropped
    step); advance(tokens) feeds them and returns the logits after them. Returns the tokens
    and extras of each step, and the drafts each row keeps [b] (a prefix of the steps)."""
    drafts, extras, chain, counts = [], [], 1.0, 0
    for i in range(k):
        if i:
            logits = advance(drafts[-1])
        confidence, take = pick(logits)
        chain = chain * confidence  # non-increasing: a row that stops stays stopped
        alive = (torch.ones_like(chain, dtype=torch.bool) if policy is None
                 else policy.keeps(chain))
        if not bool(alive.any()):
            break
        token, extra = take()
        drafts.append(token)
        extras.append(extra)
        counts = counts + alive.long()
    return drafts, extras, counts + torch.zeros_like(chain, dtype=torch.long)

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

The adaptive policy's threshold is a cost ratio of the machine it runs on, measured online
(`StepCosts`): drafting one more token costs a draft step plus the extra verify row, and pays
a whole base step with the probability that the chain up to it is accepted, so it is worth it
when that probability reaches (draft step + verify row) / base step. Where a verify row is
cheap (a CPU whose few-row GEMM runs at the bound) the policy drafts longer chains. Base
forwards are timed for the process (`COSTS`, by BaseRunner), draft steps for each policy (by
draft_chain: its drafter's own cost). Until both are measured, and for drafters whose drafts
cost no draft step (n-gram: its gate is on its acceptance-rate estimate), the threshold is
the configured one.

Each cost is the fastest of its recent timings (`RecentCost`): other work on the machine, and a
width's first forwards (allocations), only ever add time. A call that did one-time work
(models/first_use.py: a kernel choice, a weight copy) is not timed at all. And each timing is
forgotten `StepCosts.max_age` base forwards after it was taken, because the measurement steers
what gets measured: a verify width timed slow raises the threshold, the policy then stops
drafting that far, and no forward of that width comes to correct it. Forgotten widths fall back
to the configured threshold, which drafts, and so measures them again.
"""

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from megatron_specdec.models import first_use

POLICIES = ("adaptive", "fixed")
DEFAULT_THRESHOLD = 0.3
# A measured threshold is kept inside these: a noisy first timing never stops drafting for
# good, nor makes every draft look free.
THRESHOLD_RANGE = (0.02, 0.9)


class RecentCost:
    """The cost of a repeated operation from its recent wall times: the fastest of the last
    `window` that are younger than `max_age` ticks (base forwards, StepCosts.forwards); None
    when there is none. Each timing ages on its own, so a cost timed again after being
    forgotten is the new timings only."""

    def __init__(self, window: int = 8):
        self.times = deque(maxlen=window)  # (seconds, tick)

    def record(self, seconds: float, now: int):
        self.times.append((seconds, now))

    def value(self, now: int, max_age: int) -> Optional[float]:
        return min((t for t, tick in self.times if now - tick < max_age), default=None)


class StepCosts:
    """Recent wall times of base forwards by tokens per row (1..max_rows)."""

    def __init__(self, window: int = 8, max_age: int = 256, max_rows: int = 16):
        self.window, self.max_age, self.max_rows = window, max_age, max_rows
        self.forwards = 0  # base forwards timed: the clock recent costs age by
        self.base = {}  # tokens per row -> RecentCost

    def record_base(self, rows: int, seconds: float):
        if 1 <= rows <= self.max_rows:
            self.forwards += 1
            self.base.setdefault(rows, RecentCost(self.window)).record(seconds, self.forwards)

    def fresh(self, cost: RecentCost) -> Optional[float]:
        """`cost` now (None: never timed, or forgotten)."""
        return cost.value(self.forwards, self.max_age)

    def threshold(self, draft: RecentCost) -> Optional[float]:
        """(draft step + one more verify row) / one-token base step, from a least-squares
        line through the base times; None until a draft step and two row counts are timed
        (and not forgotten)."""
        draft_seconds = self.fresh(draft)
        base = {rows: t for rows, cost in self.base.items()
                if (t := self.fresh(cost)) is not None}
        if draft_seconds is None or len(base) < 2:
            return None
        xs, ys = list(base), list(base.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys))
                    / sum((x - mx) ** 2 for x in xs))
        step = my + slope * (1 - mx)
        if step <= 0:
            return None
        low, high = THRESHOLD_RANGE
        return min(high, max(low, (draft_seconds + slope) / step))


# This process's base forwards (generation's decoding model): BaseRunner records into it.
COSTS = StepCosts()


@dataclass(frozen=True)
class DraftPolicy:
    max_tokens: int
    threshold: Optional[float] = DEFAULT_THRESHOLD  # None: always draft max_tokens
    max_backoff: int = 32
    measured: bool = False  # the threshold is the measured cost ratio once there is one
    # One draft step of this policy's drafter.
    draft_cost: RecentCost = field(default_factory=RecentCost, compare=False, repr=False)

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

    def current_threshold(self) -> Optional[float]:
        """The threshold in force now (None: a fixed chain)."""
        if self.threshold is None or not self.measured:
            return self.threshold
        measured = COSTS.threshold(self.draft_cost)
        return self.threshold if measured is None else measured

    @property
    def tree_floor(self) -> float:
        """The cumulative log-prob a draft tree node needs (tree.grow_tree)."""
        threshold = self.current_threshold()
        return float("-inf") if not threshold else math.log(threshold)

    def keeps(self, chain_prob: Tensor) -> Tensor:
        """Per row, whether a draft token whose chain (it and the drafts before it) is
        accepted with probability `chain_prob` [b] is worth drafting and verifying."""
        threshold = self.current_threshold()
        if threshold is None:
            return torch.ones_like(chain_prob, dtype=torch.bool)
        return chain_prob >= threshold

    @classmethod
    def named(cls, name: str, max_tokens: int, threshold: float = DEFAULT_THRESHOLD):
        """"adaptive": the measured threshold (`threshold` until measured); "fixed": k."""
        if name not in POLICIES:
            raise ValueError(f"draft policy {name!r}; expected one of {POLICIES}")
        if name == "fixed":
            return cls(max_tokens, None)
        return cls(max_tokens, threshold, measured=True)


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
            started, work = time.perf_counter(), first_use.count()
            logits = advance(drafts[-1])
            confidence, take = pick(logits)
            if policy is not None and first_use.count() == work:  # a step's cost, nothing more
                policy.draft_cost.record(time.perf_counter() - started, COSTS.forwards)
        else:
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

"""Acceptance metrics of speculative generation, from the accepted-draft count of each
verify forward (0..k).

- Acceptance length (tau): tokens emitted per verify forward, the bonus/correction token
  included, so 1.0 means no gain. Pooled over forwards (total tokens / total forwards), not
  averaged per prompt. The prefill forward, which drafts nothing, is not counted.
- Per-position acceptance: P(draft j accepted | draft j-1 accepted), j = 1..k, over the
  forwards that drafted j tokens or more (an adaptive policy drafts fewer than k).
"""

from typing import Dict, List, Sequence


def acceptance_summary(accepted: Sequence[int], num_draft_tokens: int,
                       drafted: Sequence[int] = None) -> Dict:
    """`drafted`: drafts per forward (default: k each)."""
    k = num_draft_tokens
    drafted = [k] * len(accepted) if drafted is None else list(drafted)
    if len(drafted) != len(accepted) or any(not 0 <= a <= d <= k
                                            for a, d in zip(accepted, drafted)):
        raise ValueError(f"need 0 <= accepted <= drafted <= {k} for every forward")
    rounds = len(accepted)
    reached = [sum(a >= j - 1 and d >= j for a, d in zip(accepted, drafted))
               for j in range(1, k + 1)]
    hits = [sum(a >= j for a in accepted) for j in range(1, k + 1)]
    return {
        "verify_forwards": rounds,
        "emitted_tokens": sum(accepted) + rounds,
        "acceptance_length": (sum(accepted) + rounds) / rounds if rounds else None,
        "position_acceptance": [h / r if r else None for h, r in zip(hits, reached)],
        "position_reached": reached,
        "accepted_histogram": [sum(a == n for a in accepted) for n in range(k + 1)],
        "mean_drafted": sum(drafted) / rounds if rounds else None,
    }


def _pooled(records: List[Dict], num_draft_tokens: int, category=None) -> Dict:
    chosen = [r for r in records if category is None or r["category"] == category]
    accepted = [a for r in chosen for a in r["accepted"]]
    drafted = [d for r in chosen
               for d in r.get("drafted", [num_draft_tokens] * len(r["accepted"]))]
    return acceptance_summary(accepted, num_draft_tokens, drafted)


def summarise_by_category(records: List[Dict], num_draft_tokens: int) -> Dict:
    """records: {"category", "accepted"[, "drafted"]} per prompt -> overall and per-category
    summaries."""
    categories = sorted({r["category"] for r in records})
    return {
        "overall": _pooled(records, num_draft_tokens),
        "categories": {c: _pooled(records, num_draft_tokens, c) for c in categories},
    }

"""Acceptance metrics of speculative generation, from the accepted-draft count of each
verify forward (0..k).

- Acceptance length (tau): tokens emitted per verify forward, the bonus/correction token
  included, so 1.0 means no gain. Pooled over forwards (total tokens / total forwards), not
  averaged per prompt. The prefill forward, which drafts nothing, is not counted.
- Per-position acceptance: P(draft j accepted | draft j-1 accepted), j = 1..k.
"""

from typing import Dict, List, Sequence


def acceptance_summary(accepted: Sequence[int], num_draft_tokens: int) -> Dict:
    k = num_draft_tokens
    if any(a < 0 or a > k for a in accepted):
        raise ValueError(f"accepted counts must lie in [0, {k}]")
    rounds = len(accepted)
    reached = [sum(a >= j - 1 for a in accepted) for j in range(1, k + 1)]
    hits = [sum(a >= j for a in accepted) for j in range(1, k + 1)]
    return {
        "verify_forwards": rounds,
        "emitted_tokens": sum(accepted) + rounds,
        "acceptance_length": (sum(accepted) + rounds) / rounds if rounds else None,
        "position_acceptance": [h / r if r else None for h, r in zip(hits, reached)],
        "position_reached": reached,
        "accepted_histogram": [sum(a == n for a in accepted) for n in range(k + 1)],
    }


def _pooled(records: List[Dict]) -> List[int]:
    return [a for r in records for a in r["accepted"]]


def summarise_by_category(records: List[Dict], num_draft_tokens: int) -> Dict:
    """records: {"category", "accepted"} per prompt -> overall and per-category summaries."""
    categories = sorted({r["category"] for r in records})
    return {
        "overall": acceptance_summary(_pooled(records), num_draft_tokens),
        "categories": {
            c: acceptance_summary(_pooled([r for r in records if r["category"] == c]),
                                  num_draft_tokens)
            for c in categories
        },
    }

"""Draft vocabulary calibration: the N most frequent target tokens of the training data.

The EAGLE3 draft predicts over this smaller vocabulary (a cheaper lm_head). Draft ids are
the chosen target ids sorted ascending, so `target_id = draft_id + d2t[draft_id]` and
`target_logits[..., t2d]` lists target logits in draft-id order.
The end-of-turn ids are always included even if rare: without them the draft could never
propose the end of an answer, and every answer would end with a rejected draft.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors.torch import load_file, save_file

from megatron_specdec.data.conversations import (
    end_of_turn_ids,
    read_conversations,
    tokenize_conversation,
)
from megatron_specdec.data.jsonl import DataError

log = logging.getLogger(__name__)


@dataclass
class DraftVocab:
    d2t: torch.Tensor  # int64 [draft_vocab_size]: target_id - draft_id
    t2d: torch.Tensor  # bool [vocab_size]: target id is in the draft vocabulary
    counts: torch.Tensor  # int64 [vocab_size]: calibration token counts

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def target_ids(self) -> torch.Tensor:
        """Target id of each draft id, int64 [draft_vocab_size]."""
        return torch.arange(self.draft_vocab_size) + self.d2t

    def save(self, path, metadata: Optional[dict] = None) -> None:
        """safetensors with d2t, t2d and counts; `metadata` values are stored as JSON strings."""
        meta = {k: json.dumps(v) for k, v in (metadata or {}).items()}
        save_file(
            {"d2t": self.d2t, "t2d": self.t2d, "counts": self.counts}, str(path), metadata=meta
        )

    @classmethod
    def load(cls, path) -> "DraftVocab":
        try:
            tensors = load_file(str(path))
            vocab = cls(tensors["d2t"], tensors["t2d"], tensors["counts"])
        except (OSError, KeyError, RuntimeError) as e:
            raise DataError(
                f"{path}: not a draft vocabulary file (d2t, t2d, counts): {e}"
            ) from None
        if not torch.equal(vocab.t2d.nonzero().flatten(), vocab.target_ids):
            raise DataError(f"{path}: d2t and t2d disagree")
        return vocab


def count_tokens(samples: Iterable, vocab_size: int, assistant_only: bool = True) -> torch.Tensor:
    """Token counts int64 [vocab_size] over tokenized conversations (assistant tokens by default:
    those are what the draft predicts)."""
    ids = [t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m or not assistant_only]
    ids = torch.tensor(ids, dtype=torch.int64)
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise DataError(f"token id {int(ids.max())} >= vocab size {vocab_size}")
    return torch.bincount(ids, minlength=vocab_size)


def build_draft_vocab(
    counts: torch.Tensor, draft_vocab_size: int, always_include: Iterable[int] = ()
) -> DraftVocab:
    """Top `draft_vocab_size` ids by count (ties to the lower id) plus `always_include`, sorted by id."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise DataError(
            f"--draft-vocab-size must be in [1, {vocab_size}] (the vocab size), got {draft_vocab_size}"
        )
    forced = sorted(set(always_include))
    if len(forced) > draft_vocab_size or any(not 0 <= i < vocab_size for i in forced):
        raise DataError(
            f"cannot always include ids {forced} in a draft vocab of {draft_vocab_size} over {vocab_size}"
        )
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[forced] = True
    # Stable sort on descending counts keeps ascending ids among equal counts.
    ranked = torch.sort(-counts, stable=True).indices
    rest = ranked[~chosen[ranked]][: draft_vocab_size - len(forced)]
    chosen[rest] = True
    target_ids = chosen.nonzero().flatten()
    seen = int((counts > 0).sum())
    if seen < draft_vocab_size:
        log.warning(
            "only %d distinct tokens were counted: the draft vocab of %d is filled with "
            "unseen ids (lowest first)",
            seen,
            draft_vocab_size,
        )
    return DraftVocab(target_ids - torch.arange(draft_vocab_size), chosen, counts.clone())


def model_vocab_size(tokenizer) -> int:
    """The model's vocab size (config.json beside the tokenizer, often padded past the tokenizer's)."""
    config = Path(str(tokenizer.name_or_path)) / "config.json"
    padded = json.loads(config.read_text()).get("vocab_size", 0) if config.is_file() else 0
    return max(len(tokenizer), padded)


def calibrate(
    paths,
    tokenizer,
    draft_vocab_size: int,
    assistant_only: bool = True,
    max_length: Optional[int] = None,
    vocab_size: Optional[int] = None,
    on_error: str = "skip",
) -> DraftVocab:
    """Draft vocabulary from conversation jsonl file(s), tokenized as training tokenizes them.
    `vocab_size` (t2d's length) defaults to `model_vocab_size(tokenizer)`."""
    rows = read_conversations(paths, on_error)
    if not rows:
        raise DataError(f"no usable conversation rows in calibration data {paths}")
    eos_ids = end_of_turn_ids(tokenizer)
    samples = (
        tokenize_conversation(tokenizer, r["conversations"], max_length, eos_ids) for r in rows
    )
    counts = count_tokens(samples, vocab_size or model_vocab_size(tokenizer), assistant_only)
    if not counts.any():
        raise DataError(
            f"calibration data {paths} has no {'assistant ' if assistant_only else ''}tokens"
        )
    log.info(
        "counted %d tokens (%d distinct) in %d conversations",
        int(counts.sum()),
        int((counts > 0).sum()),
        len(rows),
    )
    return build_draft_vocab(counts, draft_vocab_size, always_include=eos_ids)

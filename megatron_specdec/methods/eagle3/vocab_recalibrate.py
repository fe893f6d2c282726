"""Give a trained EAGLE3 draft (HF layout) a new draft vocabulary without retraining it from
scratch: the N most frequent target tokens of new calibration data (data/draft_vocab.py).

Tokens in both vocabularies keep their trained lm_head row; a token the draft could not
propose before starts from the base model's output row of that token (as a new draft's rows
do, methods/eagle3/layers.init_output_from_base) mapped into the trained draft's row space by
a least-squares fit over the tokens the old vocabulary holds. Everything else is copied. The draft then
needs training for its new rows; the point is that data unlike the first calibration (code,
other languages) or a larger vocabulary leaves fewer target tokens the draft can never draft.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.data.draft_vocab import DraftVocab, calibrate
from megatron_specdec.methods.eagle3 import hf_export as eagle3_hf
from megatron_specdec.methods.eagle3.hf_import import DraftMismatchError, read_hf_draft

log = logging.getLogger(__name__)


@dataclass
class Recalibration:
    kept: int  # draft tokens in both vocabularies (trained rows kept)
    added: int  # tokens new to the draft (rows from the base's output layer, mapped)
    coverage_before: float  # share of the calibration's assistant tokens the old vocab holds
    coverage_after: float


def base_output_rows(hf_dir) -> torch.Tensor:
    """The base's output layer [vocab, hidden] (the tied embedding when lm_head is absent),
    read alone from its file."""
    from megatron_specdec.checkpointing.hf_files import HFTensors

    tensors = HFTensors(hf_dir)
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        if name in tensors:
            return tensors[name]
    raise DraftMismatchError(f"{hf_dir}: no lm_head.weight or model.embed_tokens.weight")


def remap_rows(old_targets: torch.Tensor, old_rows: torch.Tensor, new_targets: torch.Tensor,
               base_rows: torch.Tensor) -> torch.Tensor:
    """lm_head rows for `new_targets` (ascending target ids): the old row where the target was
    in the old vocabulary (`old_targets`, ascending), else the base's row of the target mapped
    into the draft's row space by the least-squares map from the base's rows to the trained
    rows of the old vocabulary. (The base's rows as they are differ from trained rows by ~2x
    their norm: as an init they outvoted the trained rows, and MT-bench AL fell from 1.82 to
    1.16 before training.)"""
    where = torch.searchsorted(old_targets, new_targets).clamp(max=old_targets.numel() - 1)
    known = old_targets[where] == new_targets
    fit = torch.linalg.lstsq(base_rows[old_targets].double(), old_rows.double()).solution
    rows = (base_rows[new_targets].double() @ fit).to(old_rows.dtype)
    rows[known] = old_rows[where[known]]
    return rows


def recalibrate(draft_dir, base_hf_dir, data, out_dir, draft_vocab_size=None, max_shard_mb=None,
                overwrite=False) -> Recalibration:
    """Write the draft in `draft_dir` with the vocabulary calibrated on `data` (conversation
    jsonl paths) to `out_dir` (atomically). `draft_vocab_size` defaults to the draft's own."""
    from megatron_specdec.data.conversations import load_tokenizer

    checkpoint.check_output_dir(out_dir, overwrite)
    config, tensors = read_hf_draft(draft_dir)
    for name in ("lm_head.weight", "d2t", "t2d"):
        if name not in tensors:
            raise DraftMismatchError(f"{draft_dir}: no {name}: not a reduced-vocabulary EAGLE3 draft")
    size = draft_vocab_size or int(config["draft_vocab_size"])
    vocab = calibrate(data, load_tokenizer(base_hf_dir), size, vocab_size=int(config["vocab_size"]))
    old = DraftVocab(tensors["d2t"].long(), tensors["t2d"].bool(), vocab.counts)
    base_rows = base_output_rows(base_hf_dir)
    if tuple(base_rows.shape) != (old.vocab_size, tensors["lm_head.weight"].shape[1]):
        raise DraftMismatchError(f"{base_hf_dir}: output layer {tuple(base_rows.shape)} does not fit the "
                                 f"draft's vocabulary {old.vocab_size} x hidden "
                                 f"{tensors['lm_head.weight'].shape[1]}")
    rows = remap_rows(old.target_ids, tensors["lm_head.weight"], vocab.target_ids, base_rows)
    kept = int((old.t2d & vocab.t2d).sum())
    total = float(vocab.counts.sum())
    result = Recalibration(kept, size - kept, float(vocab.counts[old.t2d].sum()) / total,
                           float(vocab.counts[vocab.t2d].sum()) / total)
    tensors = dict(tensors, **{"lm_head.weight": rows, "d2t": vocab.d2t.to(tensors["d2t"].dtype),
                               "t2d": vocab.t2d})
    config = dict(config, draft_vocab_size=size)
    with checkpoint.atomic_output(out_dir) as tmp:
        eagle3_hf.write(tmp, config, tensors, max_shard_mb)
    log.info("draft vocabulary %d: %d tokens kept, %d new (rows mapped from the base's); calibration "
             "coverage %.4f -> %.4f", size, result.kept, result.added, result.coverage_before,
             result.coverage_after)
    return result

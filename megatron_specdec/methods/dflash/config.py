"""DFlash draft configuration, validated against the base it drafts for (the registry's
`parse_config` refuses unknown keys and calls `validate`).

The keys are the ones the engines read (`dflash_config.mask_token_id`,
`dflash_config.target_layer_ids`, `block_size`), so the export writes them unchanged.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from megatron_specdec.registry import ConfigError


class DFlashConfigError(ConfigError):
    pass


def default_target_layer_ids(num_layers: int) -> List[int]:
    """Five layers spread from the second to the fourth-last (DFlash's published drafts read
    five; 0-based output-of-layer convention, the same tensor vLLM captures at id + 1)."""
    if num_layers < 5:
        return list(range(num_layers))
    lo, hi = 1, num_layers - 3
    return sorted({round(lo + i * (hi - lo) / 4) for i in range(5)})


@dataclass
class DFlashConfig:
    block_size: int = 8  # positions per block: the anchor token and block_size - 1 masks
    num_layers: int = 1  # draft layers: one forward a round however many
    # false: every layer's key RMSNorm gain stays 1; vLLM's CPU build normalises all layers'
    # context keys with layer 0's k_norm, so it then serves a multi-layer draft as trained
    k_norm_trainable: bool = True
    mask_token_id: Optional[int] = None  # default: the base's last vocabulary id
    # base layers whose outputs are the context (0-based output-of-layer; default: five spread)
    target_layer_ids: Optional[List[int]] = None
    # blocks scored per training sequence (seq_length / block_size tiles the row)
    anchors_per_sequence: int = field(default=8, metadata={"resumable": True})
    # block position i weighs exp(-(i - 1) / gamma)
    loss_decay_gamma: float = field(default=4.0, metadata={"resumable": True})

    algo = "dflash"

    @property
    def aux_layer_ids(self) -> List[int]:
        return list(self.target_layer_ids)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate(cfg: DFlashConfig, num_base_layers: int, vocab_size: int) -> None:
    """Fill the base-dependent defaults (mask token: the last id; target layers), then refuse
    a value that cannot work in one line naming the key."""
    if cfg.mask_token_id is None:
        cfg.mask_token_id = vocab_size - 1
    if cfg.target_layer_ids is None:
        cfg.target_layer_ids = default_target_layer_ids(num_base_layers)
    if not _is_int(cfg.block_size) or cfg.block_size < 2:
        raise DFlashConfigError(
            f"dflash config: block_size must be an integer >= 2 (the anchor and at least one "
            f"mask position), got {cfg.block_size!r}")
    if not _is_int(cfg.num_layers) or cfg.num_layers < 1:
        raise DFlashConfigError(f"dflash config: num_layers must be an integer >= 1, got {cfg.num_layers!r}")
    if not isinstance(cfg.k_norm_trainable, bool):
        raise DFlashConfigError(
            f"dflash config: k_norm_trainable must be true or false, got {cfg.k_norm_trainable!r}")
    if not _is_int(cfg.mask_token_id) or not 0 <= cfg.mask_token_id < vocab_size:
        raise DFlashConfigError(
            f"dflash config: mask_token_id must be a token id in [0, {vocab_size}), "
            f"got {cfg.mask_token_id!r}")
    ids = cfg.target_layer_ids
    if (not isinstance(ids, (list, tuple)) or not ids
            or not all(_is_int(i) and 0 <= i < num_base_layers for i in ids)):
        raise DFlashConfigError(
            f"dflash config: target_layer_ids must be a non-empty list of base layer ids in "
            f"[0, {num_base_layers}), got {ids!r}")
    if len(set(ids)) != len(ids):
        raise DFlashConfigError(f"dflash config: target_layer_ids repeats a layer: {ids!r}")
    if not _is_int(cfg.anchors_per_sequence) or cfg.anchors_per_sequence < 1:
        raise DFlashConfigError(
            f"dflash config: anchors_per_sequence must be an integer >= 1, got {cfg.anchors_per_sequence!r}")
    if not isinstance(cfg.loss_decay_gamma, (int, float)) or cfg.loss_decay_gamma <= 0:
        raise DFlashConfigError(
            f"dflash config: loss_decay_gamma must be > 0, got {cfg.loss_decay_gamma!r}")


def check_num_draft_tokens(cfg: DFlashConfig, k: int) -> None:
    """A block drafts at most block_size - 1 tokens: the positions it was trained on."""
    if not 1 <= k <= cfg.block_size - 1:
        raise DFlashConfigError(f"num_draft_tokens {k}: a DFlash draft with block_size "
                                f"{cfg.block_size} drafts 1..{cfg.block_size - 1} tokens")

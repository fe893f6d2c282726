"""Medusa's draft config."""

from dataclasses import dataclass, field
from typing import List, Optional

from megatron_specdec.methods.config import check_int
from megatron_specdec.registry import ConfigError


@dataclass
class MedusaConfig:
    medusa_num_heads: int = 4
    medusa_num_layers: int = 1
    # default 0.8**i (Medusa-1); resumable: a run may change it on resume
    medusa_head_weights: Optional[List[float]] = field(default=None,
                                                       metadata={"resumable": True})

    algo = "medusa"

    @property
    def aux_layer_ids(self) -> List[int]:
        return []


def validate(cfg: MedusaConfig, num_layers: int = None, vocab_size: int = None):
    check_int("medusa_num_heads", cfg.medusa_num_heads, 1)
    check_int("medusa_num_layers", cfg.medusa_num_layers, 1)
    if cfg.medusa_head_weights is None:
        cfg.medusa_head_weights = [0.8 ** i for i in range(cfg.medusa_num_heads)]
    weights = [float(w) for w in cfg.medusa_head_weights]
    if len(weights) != cfg.medusa_num_heads or any(w < 0 for w in weights):
        raise ConfigError(
            f"medusa_head_weights needs {cfg.medusa_num_heads} non-negative values, got {weights}"
        )
    cfg.medusa_head_weights = weights



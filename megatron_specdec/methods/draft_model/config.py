"""The draft_model method's config: a separate GPT distilled against the frozen base."""

from dataclasses import dataclass
from typing import List, Optional

from megatron_specdec.registry import ConfigError


@dataclass
class DraftModelConfig:
    """A separate GPT of the base's vocabulary (e.g. checkpoint_tools/prune_depth.py's output)
    trained by distillation against the frozen base; `model` is its starting checkpoint."""
    model: Optional[str] = None

    algo = "draft_model"

    @property
    def aux_layer_ids(self) -> List[int]:
        return []


def validate(cfg: DraftModelConfig, num_layers: int = None, vocab_size: int = None):
    if not cfg.model:
        raise ConfigError("draft_model needs 'model': the checkpoint of the draft GPT to "
                              "distil (e.g. checkpoint_tools/prune_depth.py's --out)")
    cfg.model = str(cfg.model)



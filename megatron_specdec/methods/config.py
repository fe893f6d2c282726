"""Draft-module configuration: the keys ModelOpt users already write, validated against the base.

`parse(algo, config, hf_config)` accepts `convert`'s two call forms (an algorithm name with a
dict, or ModelOpt's `[(mode, dict)]` list), refuses unknown keys by name and out-of-range
values with a message that says what is valid, and fills the defaults that depend on the base
model (aux layer ids, draft vocabulary size). The result is a plain dataclass that is stored
in checkpoint metadata (`to_dict`) and rebuilt from it (`from_dict`).
"""

from dataclasses import asdict, dataclass, field, fields
from typing import List, Optional

ALGOS = ("eagle3", "medusa")  # draft modules on the base (convert, export)
# What the trainer trains: a draft module, or a separate draft model distilled from the base.
TRAINABLE = ALGOS + ("draft_model",)
# ModelOpt names its EAGLE mode "eagle"; only EAGLE3 is implemented here.
_MODE_ALIASES = {"eagle": "eagle3", "eagle3": "eagle3", "medusa": "medusa",
                 "draft_model": "draft_model"}
LM_HEAD_INITS = ("base", "random")
DRAFT_VOCAB_MULTIPLE = 128  # padded draft vocabulary is independent of TP (reshardable)


class SpecConfigError(ValueError):
    pass


def default_aux_layer_ids(num_layers: int) -> List[int]:
    """EAGLE-3's outputs of layers 1, N//2-1 and N-4 (0-based output-of-layer convention)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


@dataclass
class Eagle3Config:
    eagle_num_layers: int = 1
    use_input_layernorm_in_first_layer: bool = True
    use_last_layernorm: bool = True
    draft_vocab_size: Optional[int] = None  # default: the base vocabulary
    eagle_aux_hidden_state_layer_ids: Optional[List[int]] = None
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    # "base": lm_head rows and final norm start as the base's output rows of the draft ids
    # (so a short run learns the hidden state, not a vocabulary); "random": drawn from the seed.
    lm_head_init: str = "random"
    # Derived, stored so a checkpoint reloads at any TP: not user keys.
    padded_draft_vocab_size: Optional[int] = field(default=None, metadata={"derived": True})

    algo = "eagle3"

    @property
    def aux_layer_ids(self) -> List[int]:
        return list(self.eagle_aux_hidden_state_layer_ids)


@dataclass
class MedusaConfig:
    medusa_num_heads: int = 4
    medusa_num_layers: int = 1
    medusa_head_weights: Optional[List[float]] = None  # default 0.8**i (Medusa-1)

    algo = "medusa"

    @property
    def aux_layer_ids(self) -> List[int]:
        return []


@dataclass
class DraftModelConfig:
    """A separate GPT of the base's vocabulary (e.g. checkpoint_tools/prune_depth.py's output)
    trained by distillation against the frozen base; `model` is its starting checkpoint."""
    model: Optional[str] = None

    algo = "draft_model"

    @property
    def aux_layer_ids(self) -> List[int]:
        return []


_CLASSES = {"eagle3": Eagle3Config, "medusa": MedusaConfig, "draft_model": DraftModelConfig}


def user_keys(cls) -> List[str]:
    return [f.name for f in fields(cls) if not f.metadata.get("derived")]


def _split_form(algo, config, algos):
    """(algo, dict) from either `("eagle3", {...})` or `[("eagle", {...})]`."""
    if isinstance(algo, (list, tuple)):
        if config is not None:
            raise SpecConfigError("pass either convert(model, [(mode, config)]) or "
                                  "convert(model, algo, config), not both")
        if len(algo) != 1 or not isinstance(algo[0], (list, tuple)) or len(algo[0]) != 2:
            raise SpecConfigError(f"expected a list with one (mode, config) pair, got {algo!r}")
        algo, config = algo[0]
    name = _MODE_ALIASES.get(str(algo).lower()) if isinstance(algo, str) else None
    if name not in algos:
        raise SpecConfigError(f"unknown speculative algorithm {algo!r}; valid: {', '.join(algos)}")
    return name, dict(config or {})


def _check_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecConfigError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        hi = f"..{high}" if high is not None else " or more"
        raise SpecConfigError(f"{name}={value} is out of range (valid: {low}{hi})")


def _validate_eagle3(cfg: Eagle3Config, num_layers: int, vocab_size: int):
    _check_int("eagle_num_layers", cfg.eagle_num_layers, 1)
    _check_int("ttt_steps", cfg.ttt_steps, 1)
    if not 0.0 < float(cfg.ttt_decay) <= 1.0:
        raise SpecConfigError(f"ttt_decay={cfg.ttt_decay} is out of range (valid: (0, 1])")
    if cfg.lm_head_init not in LM_HEAD_INITS:
        raise SpecConfigError(
            f"lm_head_init={cfg.lm_head_init!r} is not one of {', '.join(LM_HEAD_INITS)}"
        )
    if cfg.draft_vocab_size is None:
        cfg.draft_vocab_size = vocab_size
    _check_int("draft_vocab_size", cfg.draft_vocab_size, 1, vocab_size)
    if cfg.eagle_aux_hidden_state_layer_ids is None:
        cfg.eagle_aux_hidden_state_layer_ids = default_aux_layer_ids(num_layers)
    ids = list(cfg.eagle_aux_hidden_state_layer_ids)
    if not ids:
        raise SpecConfigError("eagle_aux_hidden_state_layer_ids must name at least one layer")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise SpecConfigError(
                f"aux layer id {i!r} is out of range for a {num_layers}-layer base model "
                f"(valid: 0..{num_layers - 1}, output-of-layer convention)"
            )
    cfg.eagle_aux_hidden_state_layer_ids = ids
    multiple = DRAFT_VOCAB_MULTIPLE
    cfg.padded_draft_vocab_size = -(-cfg.draft_vocab_size // multiple) * multiple


def _validate_medusa(cfg: MedusaConfig):
    _check_int("medusa_num_heads", cfg.medusa_num_heads, 1)
    _check_int("medusa_num_layers", cfg.medusa_num_layers, 1)
    if cfg.medusa_head_weights is None:
        cfg.medusa_head_weights = [0.8 ** i for i in range(cfg.medusa_num_heads)]
    weights = [float(w) for w in cfg.medusa_head_weights]
    if len(weights) != cfg.medusa_num_heads or any(w < 0 for w in weights):
        raise SpecConfigError(
            f"medusa_head_weights needs {cfg.medusa_num_heads} non-negative values, got {weights}"
        )
    cfg.medusa_head_weights = weights


def _validate_draft_model(cfg: DraftModelConfig):
    if not cfg.model:
        raise SpecConfigError("draft_model needs 'model': the checkpoint of the draft GPT to "
                              "distil (e.g. checkpoint_tools/prune_depth.py's --out)")
    cfg.model = str(cfg.model)


def parse(algo, config, num_layers: int, vocab_size: int, algos=ALGOS):
    """A validated Eagle3Config, MedusaConfig (or, where `algos` allows, DraftModelConfig) for
    a base model of `num_layers` layers and `vocab_size` tokens (the defaults and range checks
    need them)."""
    name, raw = _split_form(algo, config, algos)
    cls = _CLASSES[name]
    allowed = user_keys(cls)
    unknown = sorted(k for k in raw if k not in allowed)
    if unknown:
        raise SpecConfigError(
            f"unknown {name} config key(s) {', '.join(map(repr, unknown))}; "
            f"valid keys: {', '.join(allowed)}"
        )
    cfg = cls(**raw)
    if name == "eagle3":
        _validate_eagle3(cfg, num_layers, vocab_size)
    elif name == "medusa":
        _validate_medusa(cfg)
    else:
        _validate_draft_model(cfg)
    return cfg


def to_dict(cfg) -> dict:
    return {"algo": cfg.algo, "config": asdict(cfg)}


def from_dict(entry: dict):
    """Inverse of `to_dict` (checkpoint metadata `draft` entry); already validated."""
    return _CLASSES[entry["algo"]](**entry["config"])

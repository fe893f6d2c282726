"""EAGLE3's draft config: the keys ModelOpt users already write, validated against the base."""

from dataclasses import dataclass, field
from typing import List, Optional

from megatron_specdec.methods.config import check_int
from megatron_specdec.registry import ConfigError

LM_HEAD_INITS = ("base", "random")
DRAFT_VOCAB_MULTIPLE = 128  # padded draft vocabulary is independent of TP (reshardable)


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
    ttt_steps: int = field(default=7, metadata={"resumable": True})
    ttt_decay: float = field(default=0.8, metadata={"resumable": True})
    # "base": lm_head rows and final norm start as the base's output rows of the draft ids
    # (so a short run learns the hidden state, not a vocabulary); "random": drawn from the seed.
    lm_head_init: str = "random"
    # P-EAGLE: one draft forward proposes the whole chain. Step k >= 1 reads the embedding of
    # `mask_token_id` and fc(mask_hidden) (a learned aux state) in place of the token and
    # hidden state a chain step would read; vLLM serves it as `parallel_drafting`.
    parallel_drafting: bool = False
    mask_token_id: Optional[int] = None  # default: the base's last vocabulary id
    # Derived, stored so a checkpoint reloads at any TP: not user keys.
    padded_draft_vocab_size: Optional[int] = field(default=None, metadata={"derived": True})

    algo = "eagle3"

    @property
    def aux_layer_ids(self) -> List[int]:
        return list(self.eagle_aux_hidden_state_layer_ids)


def validate(cfg: Eagle3Config, num_layers: int, vocab_size: int):
    check_int("eagle_num_layers", cfg.eagle_num_layers, 1)
    check_int("ttt_steps", cfg.ttt_steps, 1)
    if not 0.0 < float(cfg.ttt_decay) <= 1.0:
        raise ConfigError(f"ttt_decay={cfg.ttt_decay} is out of range (valid: (0, 1])")
    if cfg.lm_head_init not in LM_HEAD_INITS:
        raise ConfigError(
            f"lm_head_init={cfg.lm_head_init!r} is not one of {', '.join(LM_HEAD_INITS)}"
        )
    if not isinstance(cfg.parallel_drafting, bool):
        raise ConfigError(f"parallel_drafting must be true or false, got {cfg.parallel_drafting!r}")
    if cfg.parallel_drafting:
        if cfg.mask_token_id is None:
            cfg.mask_token_id = vocab_size - 1
        check_int("mask_token_id", cfg.mask_token_id, 0, vocab_size - 1)
    elif cfg.mask_token_id is not None:
        raise ConfigError("mask_token_id is read only with parallel_drafting: true")
    if cfg.draft_vocab_size is None:
        cfg.draft_vocab_size = vocab_size
    check_int("draft_vocab_size", cfg.draft_vocab_size, 1, vocab_size)
    if cfg.eagle_aux_hidden_state_layer_ids is None:
        cfg.eagle_aux_hidden_state_layer_ids = default_aux_layer_ids(num_layers)
    ids = list(cfg.eagle_aux_hidden_state_layer_ids)
    if not ids:
        raise ConfigError("eagle_aux_hidden_state_layer_ids must name at least one layer")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ConfigError(
                f"aux layer id {i!r} is out of range for a {num_layers}-layer base model "
                f"(valid: 0..{num_layers - 1}, output-of-layer convention)"
            )
    cfg.eagle_aux_hidden_state_layer_ids = ids
    multiple = DRAFT_VOCAB_MULTIPLE
    cfg.padded_draft_vocab_size = -(-cfg.draft_vocab_size // multiple) * multiple


def check_num_draft_tokens(cfg: Eagle3Config, k: int) -> None:
    """A parallel-drafting draft proposes at most ttt_steps tokens: the steps it was trained
    on (a chain draft may run past them)."""
    if cfg.parallel_drafting and not 1 <= k <= cfg.ttt_steps:
        raise ConfigError(f"num_draft_tokens {k}: a parallel-drafting EAGLE3 draft with "
                          f"ttt_steps {cfg.ttt_steps} drafts 1..{cfg.ttt_steps} tokens")

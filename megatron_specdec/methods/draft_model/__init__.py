"""A separate draft GPT of the base's vocabulary (e.g. depth-pruned from the base, pruning.py),
distilled against the frozen base and drafting chains with its own KV cache."""

from megatron_specdec.methods.draft_model.config import DraftModelConfig, validate
from megatron_specdec.registry import DraftMethod, lazy

_P = "megatron_specdec.methods.draft_model"

METHOD = DraftMethod(
    name="draft_model",
    summary="a separate GPT of the base's vocabulary, distilled against the base",
    config_class=DraftModelConfig,
    validate=validate,
    attach=lazy(f"{_P}.attach:attach"),
    attach_config_key="model",
    loss=lazy(f"{_P}.loss:loss"),
    trainable=True,
    evaluated_in_training=False,
    proposer=lazy(f"{_P}.proposer:make_proposer"),
    needs_module=False,
    needs_draft_checkpoint=True,
    draft_vocab_size=lambda model: model.vocab_size,
    save_trained=lazy(f"{_P}.attach:save_trained"),
    engine_config=lazy(f"{_P}.engines:engine_config"),
)

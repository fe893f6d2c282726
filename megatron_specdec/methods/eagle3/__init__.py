"""EAGLE3: a one-layer draft on the base's aux hidden states (three layers' outputs), trained
with training-time test, drafting chains or trees over a calibrated draft vocabulary."""

from megatron_specdec.methods.eagle3.config import Eagle3Config, check_num_draft_tokens, validate
from megatron_specdec.registry import DraftMethod, lazy

_P = "megatron_specdec.methods.eagle3"

METHOD = DraftMethod(
    name="eagle3",
    summary="EAGLE-3 draft layer on three aux hidden states of the base",
    config_class=Eagle3Config,
    validate=validate,
    attach=lazy(f"{_P}.attach:attach"),
    on_base=True,
    aux_layer_ids=lambda cfg: cfg.aux_layer_ids,
    carries_embeds=True,
    set_draft_vocab=lazy(f"{_P}.attach:set_draft_vocab"),
    loss=lazy(f"{_P}.loss:loss"),
    loss_steps=lambda cfg: cfg.ttt_steps,
    trainable=True,
    supports_recompute=True,
    proposer=lazy(f"{_P}.proposer:make_proposer"),
    default_num_draft_tokens=lambda cfg: cfg.ttt_steps,
    check_num_draft_tokens=check_num_draft_tokens,
    draft_vocab_size=lambda model: model.spec_config.draft_vocab_size,
    drafts_trees=True,
    export_hf=lazy(f"{_P}.hf_export:export_eagle3"),
    import_hf=lazy(f"{_P}.hf_import:import_eagle3"),
    check_export=lazy(f"{_P}.hf_import:check_export"),
    engine_config=lazy(f"{_P}.engines:engine_config"),
)

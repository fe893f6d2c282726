"""DFlash: a block drafter. One draft forward over [last token, mask x (k)] reads the base's
aux hidden states as context keys/values and proposes k tokens (vLLM's DFlashDraftModel)."""

from megatron_specdec.methods.dflash.config import DFlashConfig, validate
from megatron_specdec.registry import DraftMethod, lazy

_P = "megatron_specdec.methods.dflash"

METHOD = DraftMethod(
    name="dflash",
    summary="DFlash block drafter: k tokens in one draft forward over the base's aux states",
    config_class=DFlashConfig,
    validate=validate,
    attach=lazy(f"{_P}.model:build_draft"),
    on_base=True,
    aux_layer_ids=lambda cfg: cfg.aux_layer_ids,
    carries_embeds=True,
    loss=lazy(f"{_P}.loss:dflash_loss"),
    loss_steps=lambda cfg: cfg.block_size - 1,
    trainable=True,
    proposer=lazy(f"{_P}.proposer:make_proposer"),
    default_num_draft_tokens=lambda cfg: cfg.block_size - 1,
    check_num_draft_tokens=lazy(f"{_P}.config:check_num_draft_tokens"),
    draft_vocab_size=lambda model: model.vocab_size,
    drafts_trees=True,
    export_hf=lazy(f"{_P}.hf_export:export_dflash"),
    import_hf=lazy(f"{_P}.hf_export:import_dflash"),
    engine_config=lazy(f"{_P}.engines:engine_config"),
)

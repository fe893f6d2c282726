"""Medusa: heads on the base's final hidden state, head i predicting the token i + 2 ahead."""

from megatron_specdec.methods.medusa.config import MedusaConfig, validate
from megatron_specdec.registry import DraftMethod, lazy

_P = "megatron_specdec.methods.medusa"


def _export(ckpt_dir, out_dir, dtype=None, overwrite=False, max_shard_mb=None):
    if max_shard_mb:
        raise ValueError("--max-shard-mb applies to EAGLE3 exports")
    from megatron_specdec.methods.medusa.hf_export import export_medusa

    return export_medusa(ckpt_dir, out_dir, dtype=dtype, overwrite=overwrite)


METHOD = DraftMethod(
    name="medusa",
    summary="Medusa heads on the base's final hidden state",
    config_class=MedusaConfig,
    validate=validate,
    attach=lazy(f"{_P}.attach:attach"),
    on_base=True,
    captures_final=True,
    loss=lazy(f"{_P}.loss:loss"),
    loss_steps=lambda cfg: cfg.medusa_num_heads,
    trainable=True,
    proposer=lazy(f"{_P}.proposer:make_proposer"),
    default_num_draft_tokens=lambda cfg: cfg.medusa_num_heads,
    check_num_draft_tokens=lazy(f"{_P}.proposer:check_num_draft_tokens"),
    draft_vocab_size=lambda model: model.vocab_size,
    drafts_trees=True,
    typical_acceptance=True,
    export_hf=_export,
    engine_config=lazy(f"{_P}.engines:engine_config"),
)

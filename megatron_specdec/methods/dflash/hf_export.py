"""The registry's export/import hooks for DFlash: a speculative or training checkpoint (any
saved TP/PP) <-> vLLM's DFlashDraftModel directory (hf_weights holds the layout)."""

from pathlib import Path

from megatron_specdec import registry
from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.checkpointing import hf_mapping as mapping
from megatron_specdec.export import draft_source
from megatron_specdec.methods.dflash import hf_weights


def export_dflash(ckpt_dir, out_dir, dtype=None, overwrite=False, max_shard_mb=None):
    """Write the DFlash draft of a checkpoint as a DFlashDraftModel directory. `dtype`:
    float32 | bfloat16 | float16 (default: as trained). A small draft: one file, so
    `max_shard_mb` is not used. Nothing is written unless every tensor maps."""
    checkpoint.check_output_dir(out_dir, overwrite)
    source = draft_source.read_draft(ckpt_dir, "dflash")
    geo = mapping.Geometry.from_hf(source.hf_config, source.meta["padding"])
    dtype_name = dtype or source.meta["dtype"]
    _, stream = draft_source.hf_stream(hf_weights.rules(), source, geo, source.cfg.num_layers,
                                       dtype_name)
    state = dict(stream)
    torch_dtype = checkpoint.dtype_from_name(dtype_name)
    config = hf_weights.hf_config(source.hf_config, source.cfg, geo, torch_dtype)
    with checkpoint.atomic_output(out_dir) as tmp:
        hf_weights.write_export(tmp, config, state, torch_dtype)
    return Path(out_dir)


def _config_of(config: dict, num_base_layers: int, vocab_size: int):
    dcfg = config["dflash_config"]
    cfg = registry.get("dflash").config_class(
        block_size=config.get("block_size", 8), num_layers=config["num_hidden_layers"],
        mask_token_id=dcfg["mask_token_id"], target_layer_ids=list(dcfg["target_layer_ids"]))
    registry.get("dflash").validate(cfg, num_base_layers, vocab_size)
    return cfg


def _import_worker(base_ckpt, out_ckpt, cfg_entry, draft_dir, tp, pp, overwrite):
    from megatron_specdec import distributed
    from megatron_specdec.loading.base import load_base_model
    from megatron_specdec.loading.speculative import save_speculative
    from megatron_specdec.models.speculative import attach

    distributed.initialize(tp, pp)
    meta = checkpoint.base_meta_of(checkpoint.read_meta(base_ckpt))
    base, hf_config = load_base_model(base_ckpt, meta)
    model = attach(base, registry.config_from_dict(cfg_entry), hf_config)
    hf_weights.import_into(model, draft_dir)
    save_speculative(model, out_ckpt, meta, Path(base_ckpt) / checkpoint.TOKENIZER_DIR, overwrite)


def import_dflash(draft_dir, base_ckpt, out_ckpt, tp=1, pp=1, overwrite=False):
    """DFlashDraftModel directory + base (or speculative) checkpoint -> speculative checkpoint
    at TP x PP (spawns tp*pp local processes). Returns the draft's DFlashConfig."""
    from megatron_specdec import distributed

    meta = checkpoint.base_meta_of(checkpoint.read_meta(base_ckpt))
    base = checkpoint.hf_config_from_meta(meta)
    config, _ = hf_weights.read_export(draft_dir)
    if config["hidden_size"] != base.hidden_size:
        raise ValueError(f"{Path(draft_dir) / 'config.json'}: hidden_size {config['hidden_size']} "
                         f"!= the base's {base.hidden_size} (the draft shares its embeddings)")
    cfg = _config_of(config, base.num_hidden_layers, base.vocab_size)
    checkpoint.check_output_dir(out_ckpt, overwrite, "checkpoint directory")
    distributed.spawn(_import_worker, tp * pp, str(base_ckpt), str(out_ckpt),
                      registry.config_to_dict(cfg), str(draft_dir), tp, pp, overwrite)
    return cfg

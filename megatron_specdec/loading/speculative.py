"""Speculative checkpoints (base + draft module in one dist checkpoint): rebuild one at the
current TP/PP, save one, and save what a training run leaves."""

from megatron_specdec import registry
from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.models.provider import build_model
from megatron_specdec.models.speculative import attach


def speculative_meta(base_meta: dict, cfg) -> dict:
    meta = dict(base_meta)
    meta["draft"] = registry.config_to_dict(cfg)
    return meta


def load_speculative(path, dtype=None, transformer_impl=None, recompute: bool = False,
                     meta=None):
    """(speculative model, hf_config, meta) of a speculative checkpoint at the current TP/PP
    (`recompute`: see build_draft; `meta`: its metadata when the caller has read and vetted
    it, so one load reads it once)."""
    meta = meta or checkpoint.read_meta(path)
    if "draft" not in meta:
        raise checkpoint.CheckpointError(f"{path} holds no draft module (not a speculative checkpoint)")
    hf_config = checkpoint.hf_config_from_meta(meta)
    dtype = dtype or checkpoint.dtype_from_name(meta["dtype"])
    base = build_model(hf_config, dtype=dtype, padding=meta["padding"],
                       transformer_impl=transformer_impl or meta["transformer_impl"])
    model = attach(base, registry.config_from_dict(meta["draft"]), hf_config, recompute=recompute)
    checkpoint.load_checkpoint(model, path, meta)
    return model, hf_config, meta


def save_speculative(model, path, base_meta: dict, tokenizer_dir=None, overwrite=False):
    """Collectively save a speculative model (base + draft) as one dist checkpoint."""
    return checkpoint.save_checkpoint(
        model, path, speculative_meta(base_meta, model.spec_config), tokenizer_dir, overwrite
    )


def save_trained(model, path, base_meta: dict, tokenizer_dir=None, record=None):
    """What a training run leaves at `path`: a speculative checkpoint (base + draft module),
    or what the method's `save_trained` hook writes instead (a draft GPT: the draft alone,
    whose metadata adds `record`)."""
    method = registry.get(model.algo)
    if method.save_trained is not None:
        return method.save_trained(model, path, base_meta, tokenizer_dir, record)
    return save_speculative(model, path, base_meta, tokenizer_dir, overwrite=True)

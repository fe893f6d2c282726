"""A base GPTModel stage rebuilt from a checkpoint: storage (checkpointing) reads the files,
this layer builds the model they describe."""

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.models.provider import build_model


def load_base_model(path, meta=None, dtype=None):
    """(model, hf_config): this rank's base GPTModel stage built from a checkpoint's metadata
    (config, padding, layer implementation; read here unless the caller has it) and loaded
    from it. A speculative checkpoint's base keys are a base checkpoint's, so this reads the
    base of either."""
    meta = meta or checkpoint.read_meta(path)
    config = checkpoint.hf_config_from_meta(meta)
    model = build_model(
        config, dtype=dtype or checkpoint.dtype_from_name(meta["dtype"]),
        transformer_impl=meta["transformer_impl"], padding=meta["padding"],
    )
    checkpoint.load_checkpoint(model, path, meta)
    return model, config

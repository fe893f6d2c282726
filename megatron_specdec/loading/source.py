"""One front door for loading a model from any of its forms:

- an HF model directory (config.json + safetensors), or 'default' (the embedded
  SmolLM2-135M-Instruct): imported on the fly, each rank reading only its slices;
- a base megatron_specdec checkpoint (any saved TP/PP: resharded on load);
- a speculative checkpoint (base + draft module), or its base alone (`with_draft=False`).

`identify` tells the form from the files (nothing read but metadata); `load_model` builds this
rank's TP/PP stage and returns it with what every caller needs beside it (config, the base's
metadata as a new checkpoint of it is saved with, tokenizer directory, stored draft entry).
The recipe build, chat, acceptance validation and the data generator's backend load through
it. The caller has initialised the process groups (`distributed.initialize`).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.models.default_model import DEFAULT_MODEL_ALIAS, resolve_model_path

FORMS = (f"an HF model directory (config.json and safetensors weights), {DEFAULT_MODEL_ALIAS!r} "
         f"(the embedded SmolLM2-135M-Instruct), a base megatron_specdec checkpoint, or a "
         f"speculative checkpoint")
HF, BASE, SPECULATIVE = "hf", "base checkpoint", "speculative checkpoint"


class ModelSourceError(ValueError):
    pass


@dataclass
class Source:
    path: Path
    form: str  # HF | BASE | SPECULATIVE
    hf_config: object  # the (base) model's transformers config
    meta: Optional[dict]  # a checkpoint's metadata; None for an HF directory

    @property
    def draft(self) -> Optional[dict]:
        """The stored draft entry (registry.config_to_dict) of a speculative checkpoint."""
        return (self.meta or {}).get("draft")

    @property
    def tokenizer_dir(self) -> Path:
        return self.path if self.form == HF else self.path / checkpoint.TOKENIZER_DIR


@dataclass
class LoadedModel:
    model: object  # this rank's GPTModel stage, or SpeculativeGPTModel with a draft
    hf_config: object
    base_meta: dict  # what a checkpoint of this base is saved with (checkpoint.base_meta_of)
    tokenizer_dir: Path
    draft: Optional[dict]  # the stored draft entry when the draft was loaded, else None
    path: Path


def identify(source) -> Source:
    """The form of `source` (a path or 'default'); an error naming the path and the forms
    accepted for anything else."""
    from megatron_specdec.loading import hf_conversion

    if isinstance(source, Source):
        return source
    try:
        path = resolve_model_path(source)
    except FileNotFoundError:
        raise ModelSourceError(f"model source {source}: no such file or directory; "
                               f"expected {FORMS}") from None
    if (path / checkpoint.META_FILE).is_file():
        meta = checkpoint.read_meta(path)
        if "training_checkpoint" in meta:  # it holds no base weights to build a model from
            raise ModelSourceError(
                f"model source {path} is a training checkpoint (draft and optimizer state, no "
                f"base): resume it with its recipe, or export its draft with "
                f"checkpoint_tools/export_draft.py; expected {FORMS}")
        form = SPECULATIVE if "draft" in meta else BASE
        return Source(path, form, checkpoint.hf_config_from_meta(meta), meta)
    if path.is_dir() and (path / "config.json").is_file():
        return Source(path, HF, hf_conversion.read_hf_config(path), None)
    raise ModelSourceError(
        f"model source {path} is none of the forms a model loads from: expected {FORMS} "
        f"(found neither {checkpoint.META_FILE} nor config.json)")


def load_model(source, dtype=None, transformer_impl="auto", with_draft=True,
               need_draft=False, recompute=False) -> LoadedModel:
    """This rank's stage of the model at `source` (see the module notes), in eval mode.

    dtype: the parameters' (None: a checkpoint's own, float32 for an HF directory);
    transformer_impl: the layer implementation of a model built from an HF directory (a
    checkpoint is rebuilt with the one it was saved with); with_draft: a speculative
    checkpoint loads as its SpeculativeGPTModel (False: its base alone); need_draft: refuse a
    source without a draft module, naming it; recompute: a loaded EAGLE3 draft recomputes its
    layer in backward (speculative.build_draft)."""
    from megatron_specdec.loading import hf_conversion
    from megatron_specdec.loading.base import load_base_model
    from megatron_specdec.models.provider import resolve_transformer_impl

    src = identify(source)
    if need_draft and src.form != SPECULATIVE:
        raise checkpoint.CheckpointError(
            f"{src.path} is {'an HF model directory' if src.form == HF else 'a ' + src.form}: "
            f"it holds no draft module (expected a speculative checkpoint)")
    if src.form == HF:
        dtype = dtype or torch.float32
        impl = resolve_transformer_impl(transformer_impl)
        model, config = hf_conversion.model_from_hf(src.path, dtype, impl)
        meta = hf_conversion.base_meta(config, model, dtype, impl)
        return LoadedModel(model.eval(), config, meta, src.tokenizer_dir, None, src.path)
    if src.form == SPECULATIVE and with_draft:
        from megatron_specdec.loading.speculative import load_speculative

        model, config, _ = load_speculative(src.path, dtype, recompute=recompute, meta=src.meta)
        draft = src.draft
    else:  # a speculative checkpoint's base keys are a base checkpoint's
        model, config = load_base_model(src.path, src.meta, dtype)
        draft = None
    return LoadedModel(model.eval(), config, checkpoint.base_meta_of(src.meta),
                       src.tokenizer_dir, draft, src.path)

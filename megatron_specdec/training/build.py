"""The speculative model a recipe trains, from whatever `model.path` names:

- a speculative checkpoint: loaded as is (its draft algorithm must be the recipe's; the
  recipe's training keys, e.g. DFlash's anchors a row, apply to it);
- a base megatron_specdec checkpoint, an HF directory, or 'default': the base is loaded and
  the draft built from `draft` (`convert`), so one command goes from a base model to a
  trained draft. An EAGLE3 draft vocabulary smaller than the base's is calibrated from the
  data's token counts (skipped when a checkpoint will supply the draft anyway).
`attach` initialises the draft from its own seed, so every TP/PP layout starts from the
same global draft weights.
"""

import dataclasses

import torch.distributed as dist

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.loading import source as loading
from megatron_specdec import registry
from megatron_specdec.models.default_model import resolve_model_path
from megatron_specdec.models.speculative import attach, set_draft_vocab
from megatron_specdec.training.recipe import RecipeError


def draft_config(recipe, hf_config, stored=None):
    """The validated draft config: the recipe's, or a speculative checkpoint's own."""
    if stored is not None:
        if stored["algo"] != recipe.draft.algo:
            raise RecipeError(
                f"recipe key 'draft.algo': {recipe.draft.algo!r}, but {recipe.model.path} holds "
                f"a {stored['algo']} draft")
        return _warm_start_config(recipe, hf_config, registry.config_from_dict(stored))
    try:
        return registry.parse_config(recipe.draft.algo, dict(recipe.draft.config),
                                     hf_config.num_hidden_layers, hf_config.vocab_size,
                                     registry.trainable())
    except registry.ConfigError as e:
        raise RecipeError(f"recipe key 'draft.config': {e}") from None


def _warm_start_config(recipe, hf_config, cfg):
    """A trained draft's config with the recipe's training keys (those marked resumable: they
    shape no tensor, e.g. DFlash's anchors a row) over it, so a stage that starts from an
    exported draft trains as its recipe says. Any other key the recipe sets must equal the
    draft's: a different block size or layer count cannot apply to trained weights."""
    raw, resumable = dict(recipe.draft.config), registry.resumable_keys(type(cfg))
    method = registry.get(cfg.algo)
    try:
        registry.check_user_keys(cfg.algo, type(cfg), raw)
        for key, value in raw.items():
            if key not in resumable and value != getattr(cfg, key):
                raise RecipeError(
                    f"recipe key 'draft.config.{key}': {value!r}, but the draft in "
                    f"{recipe.model.path} has {getattr(cfg, key)!r}; over a trained draft only "
                    f"{', '.join(sorted(resumable)) or 'no key'} may change")
        cfg = dataclasses.replace(cfg, **{k: v for k, v in raw.items() if k in resumable})
        if method.validate is not None:
            method.validate(cfg, hf_config.num_hidden_layers, hf_config.vocab_size)
    except registry.ConfigError as e:
        raise RecipeError(f"recipe key 'draft.config': {e}") from None
    return cfg


def _calibrated_vocab(recipe, tokenizer, cfg, vocab_size):
    """(d2t, t2d) computed on rank 0 and shared (token counting is the slow part)."""
    from megatron_specdec.data import calibrate

    box = [None]
    if dist.get_rank() == 0:
        files = list(recipe.data.calibration or recipe.data.train)
        vocab = calibrate(files, tokenizer, cfg.draft_vocab_size, vocab_size=vocab_size,
                          on_error=recipe.data.on_error)
        box = [(vocab.d2t, vocab.t2d)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def build_speculative(recipe, calibrate: bool = True):
    """(model, hf_config, base meta, tokenizer, tokenizer dir). The tokenizer is the model's
    unless the recipe names one; `calibrate=False` when a checkpoint supplies the draft. The
    model loads through the front door (loading.load_model); the draft config is checked
    against a speculative checkpoint's before any weight is read."""
    from megatron_specdec.data import load_tokenizer

    source = loading.identify(recipe.model.path)
    cfg = draft_config(recipe, source.hf_config, source.draft)
    loaded = loading.load_model(source, checkpoint.dtype_from_name(recipe.model.dtype),
                                recipe.model.transformer_impl,
                                recompute=recipe.training.recompute)
    hf_config, tokenizer_dir = loaded.hf_config, loaded.tokenizer_dir
    if recipe.data.tokenizer is not None:
        tokenizer_dir = resolve_model_path(recipe.data.tokenizer)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    if loaded.draft is not None:  # a speculative checkpoint: base and draft loaded together
        loaded.model.spec_config = cfg  # its own, with the recipe's training keys
        return loaded.model.train(), hf_config, loaded.base_meta, tokenizer, tokenizer_dir
    method = registry.get(cfg.algo)
    try:
        model = attach(loaded.model.train(), cfg, hf_config, tokenizer_dir,
                       recompute=recipe.training.recompute)
    except (checkpoint.CheckpointError, ValueError) as e:
        if method.attach_config_key is None:
            raise
        raise RecipeError(f"recipe key 'draft.config.{method.attach_config_key}': {e}") \
            from None
    if calibrate and method.set_draft_vocab is not None and \
            cfg.draft_vocab_size < hf_config.vocab_size:
        set_draft_vocab(model, *_calibrated_vocab(recipe, tokenizer, cfg, hf_config.vocab_size))
    return model, hf_config, loaded.base_meta, tokenizer, tokenizer_dir

"""`megatron_specdec.convert(model, algo, config)`: a GPTModel -> a SpeculativeGPTModel.

The draft module is built on the last pipeline stage of the current TP/PP layout and
initialised (EAGLE3: drawn in the HF layout from one seed, so every TP layout starts from the
same draft, see weights/eagle3_init.py, with lm_head rows and final norm taken from the base
unless `lm_head_init="random"`; Medusa: identity blocks and lm_heads copied from the
base lm_head); the base is frozen. `load_speculative` rebuilds a
speculative model from a checkpoint written by `save_speculative` (spec_conversion turns a
base checkpoint into one).
"""

import torch

from megatron_specdec import checkpoint, families, spec_config
from megatron_specdec.distributed import device
from megatron_specdec.spec_model import SpeculativeGPTModel


def _base_lm_head(model):
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def build_draft(model, cfg, vocab_size: int, real_query_groups: int, seed: int = 1234,
                recompute: bool = False):
    """This stage's draft module (None before the last stage), initialised from its own seed
    so a conversion is reproducible whatever the base stage consumed of the random stream.
    `recompute`: the draft's config asks for megatron's full-layer recompute (the base's
    does not change)."""
    if not model.post_process:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _new_draft(model, cfg, vocab_size, real_query_groups, seed,
                          recompute).to(device())


def _new_draft(model, cfg, vocab_size, real_query_groups, seed, recompute):
    import dataclasses

    from megatron.core.transformer.spec_utils import build_module

    from megatron_specdec.layers import specs
    from megatron_specdec.layers.medusa import MedusaHeads
    from megatron_specdec.weights import eagle3_init

    config = model.config
    if recompute:
        config = dataclasses.replace(config, recompute_granularity="full",
                                     recompute_method="uniform", recompute_num_layers=1)
    if cfg.algo == "medusa":
        draft = MedusaHeads(config, cfg.medusa_num_heads, cfg.medusa_num_layers, vocab_size,
                            model.vocab_size)
        draft.init_lm_heads(_base_lm_head(model))
    else:
        draft = build_module(
            specs.eagle3_module_spec(cfg), config=config,  # HF EAGLE3 layers: no q/k norm
            num_aux=len(cfg.aux_layer_ids), draft_vocab_size=cfg.draft_vocab_size,
            padded_draft_vocab_size=cfg.padded_draft_vocab_size, vocab_size=vocab_size,
        )
        eagle3_init.initialize_draft(draft, config, cfg, real_query_groups, vocab_size, seed)
        _init_eagle3_output(model, draft, cfg)
    return draft


def _init_eagle3_output(base, draft, cfg):
    if cfg.lm_head_init == "base":
        draft.init_output_from_base(_base_lm_head(base), base.decoder.final_layernorm.weight)


def set_draft_vocab(model: SpeculativeGPTModel, d2t, t2d):
    """Install a calibrated draft vocabulary in a fresh EAGLE3 draft (this stage's, if any);
    lm_head rows initialised from the base follow their new target ids."""
    if model.draft is not None:
        model.draft.set_draft_vocab(d2t, t2d)
        _init_eagle3_output(model.base, model.draft, model.spec_config)


def load_draft_gpt(path, dtype, vocab_size: int, tokenizer_dir=None):
    """The draft GPT of checkpoint `path` (refused unless it is a plain GPT of the base's
    vocabulary), in `dtype`, whole on this rank, trainable, as a DraftGPT. Collective over
    the world: the checkpoint reader is."""
    from megatron_specdec.decoding.draft_model_drafter import load_draft_model
    from megatron_specdec.layers.draft_gpt import DraftGPT

    gpt = load_draft_model(path, vocab_size, tokenizer_dir, dtype)
    return DraftGPT(gpt.requires_grad_(True).train())


def attach(model, cfg, hf_config=None, tokenizer_dir=None,
           recompute: bool = False) -> SpeculativeGPTModel:
    """Wrap `model` with the draft described by an already validated config (a draft GPT is
    read from `cfg.model` on every rank and kept on the last stage; `tokenizer_dir`: the
    base's, which its tokenizer must equal; `recompute`: see build_draft)."""
    vocab_size = hf_config.vocab_size if hf_config is not None else model.vocab_size
    if cfg.algo == "draft_model":
        draft = load_draft_gpt(cfg.model, model.config.params_dtype, vocab_size, tokenizer_dir)
        return SpeculativeGPTModel(model, cfg, draft if model.post_process else None, vocab_size)
    groups = (families.query_groups(hf_config) if hf_config is not None
              else model.config.num_query_groups)
    draft = build_draft(model, cfg, vocab_size, groups, recompute=recompute)
    return SpeculativeGPTModel(model, cfg, draft, vocab_size)


def convert(model, algo, config=None, hf_config=None) -> SpeculativeGPTModel:
    """The speculative model for this rank's GPTModel stage.

    algo: "eagle3" | "medusa" with a config dict, or ModelOpt's `[(mode, config)]` list
    (config then omitted). Keys: see spec_config (unknown keys are refused by name).
    hf_config: the base's HF config; needed when the model was built with a padded
    vocabulary or padded query groups (model_provider pads both for TP), so that padded
    ids are masked and padded groups start at zero.
    """
    vocab_size = hf_config.vocab_size if hf_config is not None else model.vocab_size
    cfg = spec_config.parse(algo, config, model.config.num_layers, vocab_size)
    return attach(model, cfg, hf_config)


def speculative_meta(base_meta: dict, cfg) -> dict:
    meta = dict(base_meta)
    meta["draft"] = spec_config.to_dict(cfg)
    return meta


def load_speculative(path, dtype=None, transformer_impl=None, recompute: bool = False):
    """(speculative model, hf_config, meta) of a speculative checkpoint at the current TP/PP
    (`recompute`: see build_draft)."""
    from megatron_specdec.model_provider import build_model

    meta = checkpoint.read_meta(path)
    if "draft" not in meta:
        raise checkpoint.CheckpointError(f"{path} holds no draft module (not a speculative checkpoint)")
    hf_config = checkpoint.hf_config_from_meta(meta)
    dtype = dtype or checkpoint.dtype_from_name(meta["dtype"])
    base = build_model(hf_config, dtype=dtype, padding=meta["padding"],
                       transformer_impl=transformer_impl or meta["transformer_impl"])
    model = attach(base, spec_config.from_dict(meta["draft"]), hf_config, recompute=recompute)
    checkpoint.load_checkpoint(model, path)
    return model, hf_config, meta


def save_speculative(model, path, base_meta: dict, tokenizer_dir=None, overwrite=False):
    """Collectively save a speculative model (base + draft) as one dist checkpoint."""
    return checkpoint.save_checkpoint(
        model, path, speculative_meta(base_meta, model.spec_config), tokenizer_dir, overwrite
    )


def save_trained(model, path, base_meta: dict, tokenizer_dir=None, record=None):
    """What a training run leaves at `path`: a speculative checkpoint (base + draft module),
    or, for a draft GPT, the draft alone as a plain GPT checkpoint (what `--drafter
    draft-model` and megatron_to_hf read) whose metadata adds `distilled` (`record`)."""
    if model.algo != "draft_model":
        return save_speculative(model, path, base_meta, tokenizer_dir, overwrite=True)
    from megatron_specdec.layers.draft_gpt import replicas

    meta = checkpoint.base_meta_of(checkpoint.read_meta(model.spec_config.model))
    meta.update(dtype=checkpoint.dtype_name(model.config.params_dtype), distilled=record or {})
    draft = model.draft  # the last stage's; other stages write nothing
    state = replicas(draft.gpt.sharded_state_dict()) if draft is not None else {}
    return checkpoint.save_checkpoint(None, path, meta, tokenizer_dir, overwrite=True,
                                      sharded_state_dict=state)

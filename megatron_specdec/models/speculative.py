"""`megatron_specdec.convert(model, algo, config)`: a GPTModel -> a SpeculativeGPTModel.

The draft module is built on the last pipeline stage of the current TP/PP layout and
initialised (EAGLE3: drawn in the HF layout from one seed, so every TP layout starts from the
same draft, see methods/eagle3/init.py, with lm_head rows and final norm taken from the base
unless `lm_head_init="random"`; Medusa: identity blocks and lm_heads copied from the
base lm_head); the base is frozen. loading/speculative.py saves and rebuilds speculative
checkpoints (loading/conversion.py turns a base checkpoint into one).
"""

import torch

from megatron_specdec.models import families
from megatron_specdec.methods import config as spec_config
from megatron_specdec.distributed import device
from megatron_specdec.models.speculative_gpt import SpeculativeGPTModel


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

    from megatron_specdec.methods.eagle3 import specs
    from megatron_specdec.methods.medusa.layers import MedusaHeads
    from megatron_specdec.methods.eagle3 import init as eagle3_init

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
    from megatron_specdec.methods.draft_model.proposer import load_draft_model
    from megatron_specdec.methods.draft_model.layers import DraftGPT

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

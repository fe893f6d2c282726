"""`megatron_specdec.convert(model, algo, config)`: a GPTModel -> a SpeculativeGPTModel.

The draft module is built on the last pipeline stage of the current TP/PP layout and
initialised (EAGLE3: drawn in the HF layout from one seed, so every TP layout starts from the
same draft, see methods/eagle3/init.py, with lm_head rows and final norm taken from the base
unless `lm_head_init="random"`; Medusa: identity blocks and lm_heads copied from the
base lm_head); the base is frozen. loading/speculative.py saves and rebuilds speculative
checkpoints (loading/conversion.py turns a base checkpoint into one).
"""

import dataclasses

import torch

from megatron_specdec import registry
from megatron_specdec.distributed import device
from megatron_specdec.models import families
from megatron_specdec.models.speculative_gpt import SpeculativeGPTModel


def base_lm_head(model):
    """The base's output weight (its embedding when tied): drafts initialise from it."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def draft_layer_config(config, recompute: bool):
    """The config a draft module's layers are built with: the base's, asking for megatron's
    full-layer recompute when `recompute` (the base's does not change)."""
    if not recompute:
        return config
    return dataclasses.replace(config, recompute_granularity="full",
                               recompute_method="uniform", recompute_num_layers=1)


def seeded_draft(model, seed: int, build):
    """`build()`'s draft module on the last stage (None before it), initialised from its own
    seed so a conversion is reproducible whatever the base stage consumed of the random
    stream."""
    if not model.post_process:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().to(device())


def build_draft(model, cfg, vocab_size: int, real_query_groups: int, seed: int = 1234,
                recompute: bool = False, tokenizer_dir=None):
    """This stage's draft module of the method `cfg` names (None before the last stage);
    `recompute`: see draft_layer_config. Called on every rank."""
    method = registry.get(cfg.algo)
    return method.attach(model, cfg, vocab_size, real_query_groups, seed, recompute,
                         tokenizer_dir)


def set_draft_vocab(model: SpeculativeGPTModel, d2t, t2d):
    """Install a calibrated draft vocabulary in a fresh draft (this stage's, if any)."""
    method = registry.get(model.algo)
    if method.set_draft_vocab is None:
        raise ValueError(f"a {model.algo} draft has no draft vocabulary to calibrate")
    method.set_draft_vocab(model, d2t, t2d)


def attach(model, cfg, hf_config=None, tokenizer_dir=None,
           recompute: bool = False) -> SpeculativeGPTModel:
    """Wrap `model` with the draft described by an already validated config (`tokenizer_dir`:
    the base's, for a method that reads a draft of its own and checks its tokenizer;
    `recompute`: see build_draft)."""
    vocab_size = hf_config.vocab_size if hf_config is not None else model.vocab_size
    groups = (families.query_groups(hf_config) if hf_config is not None
              else model.config.num_query_groups)
    draft = build_draft(model, cfg, vocab_size, groups, recompute=recompute,
                        tokenizer_dir=tokenizer_dir)
    return SpeculativeGPTModel(model, cfg, draft, vocab_size)


def convert(model, algo, config=None, hf_config=None) -> SpeculativeGPTModel:
    """The speculative model for this rank's GPTModel stage.

    algo: a method that attaches a module (registry.attaching(): "eagle3", "medusa", ...)
    with a config dict, or ModelOpt's `[(mode, config)]` list (config then omitted). Keys:
    the method's config class (unknown keys are refused by name).
    hf_config: the base's HF config; needed when the model was built with a padded
    vocabulary or padded query groups (models.provider pads both for TP), so that padded
    ids are masked and padded groups start at zero.
    """
    vocab_size = hf_config.vocab_size if hf_config is not None else model.vocab_size
    cfg = registry.parse_config(algo, config, model.config.num_layers, vocab_size)
    return attach(model, cfg, hf_config)

"""megatron_specdec: speculative decoding for Megatron-Core GPT models.

The public API (lazy: importing megatron-core takes seconds, and `import megatron_specdec`
must stay cheap for the CLI's --help):

    convert(model, algo, config)       a GPTModel stage -> a SpeculativeGPTModel (models.speculative)
    load_model(source)                 a path or 'default' -> this rank's model (loading.source)
    SpeculativeGenerator               speculative generation (inference.generator)
    evaluate_acceptance                acceptance length over a prompt set (evaluation.acceptance)
    registry                           the draft methods: registry.get(name), names(), register()
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "convert": "megatron_specdec.models.speculative",
    "load_model": "megatron_specdec.loading.source",
    "SpeculativeGenerator": "megatron_specdec.inference.generator",
    "evaluate_acceptance": "megatron_specdec.evaluation.acceptance",
}

__all__ = ["SpeculativeGenerator", "convert", "evaluate_acceptance", "load_model", "registry"]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'megatron_specdec' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)

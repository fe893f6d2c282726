"""EAGLE3 draft module -> the Hugging Face `LlamaForCausalLMEagle3` layout engines load.

Directory: `config.json` + `model.safetensors` (no embedding: the engine shares the target's).
Aux layer ids: `eagle_config.eagle_aux_hidden_state_layer_ids` holds the 0-based
output-of-layer ids this project trains with (ModelOpt, TRT-LLM, SGLang, SpecForge read them
so); the top-level `eagle_aux_hidden_state_layer_ids` holds vLLM's ids for the same layers,
one higher (vLLM id k = the residual stream entering layer k = after k layers), which vLLM
reads before the nested key.
"""

import json
import logging
from pathlib import Path

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.models import families
from megatron_specdec.export import draft_source
from megatron_specdec.methods.eagle3 import hf_weights as eagle3
from megatron_specdec.checkpointing import hf_files as files
# The layout's names and shapes live with its weight table; tests read them from here too.
from megatron_specdec.methods.eagle3.hf_weights import layer_prefix, tensor_shapes  # noqa: F401

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = files.HF_WEIGHTS
INDEX = files.HF_INDEX
CONFIG = "config.json"


def vllm_layer_ids(layer_ids):
    """Output-of-layer ids -> vLLM's (hidden state entering layer k)."""
    return [i + 1 for i in layer_ids]


def hf_config(base, cfg, dtype_name: str) -> dict:
    """config.json of the draft: the base's Llama fields (the draft layer is built from the
    base's TransformerConfig) and the rope settings the draft used in training (the base's)."""
    rope = families.rope_settings(base)  # also refuses scalings training could not have used
    scaling = getattr(base, "rope_scaling", None) or getattr(base, "rope_parameters", None)
    scaling = dict(scaling or {})
    scaling.pop("rope_theta", None)
    head_dim = families.head_dim(base)
    if head_dim * base.num_attention_heads != base.hidden_size:
        log.warning("head_dim %d != hidden_size / num_attention_heads: the EAGLE reference "
                    "runtime derives the head size from hidden_size and would mis-size heads",
                    head_dim)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": base.hidden_size,
        "intermediate_size": base.intermediate_size,
        "num_attention_heads": base.num_attention_heads,
        "num_key_value_heads": families.query_groups(base),
        "head_dim": head_dim,
        "num_hidden_layers": cfg.eagle_num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": base.rms_norm_eps,
        "max_position_embeddings": base.max_position_embeddings,
        "vocab_size": base.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "rope_theta": rope["rotary_base"],
        "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
        # SGLang makes a tied draft's lm_head the shared embedding: the draft's own is separate.
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        # transformers 5 reads `dtype`; TRT-LLM and older transformers read `torch_dtype`.
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(cfg.aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": cfg.aux_layer_ids,
            "aux_layer_id_convention": "0-based output of layer (vLLM: top-level key, +1)",
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": cfg.use_input_layernorm_in_first_layer,
            "use_last_layernorm": cfg.use_last_layernorm,
        },
    }
    if cfg.parallel_drafting:  # vLLM: speculative_config parallel_drafting, mask_hidden
        config["parallel_drafting"] = True
        config["mask_token_id"] = cfg.mask_token_id
        config["eagle_config"]["parallel_draft_positions"] = cfg.ttt_steps
    # No `target_hidden_size`: the draft's hidden size is the base's, and the key would make
    # the EAGLE reference runtime expect the draft's own embed_tokens in the file.
    return config


def hf_stream(source: draft_source.DraftSource, dtype_name=None):
    """(specs, stream) of the draft's HF tensors, read one checkpoint tensor at a time."""
    cfg = source.cfg
    geo = eagle3.geometry(source.hf_config, source.meta["padding"], cfg)
    return draft_source.hf_stream(eagle3.rules(cfg), source, geo, cfg.eagle_num_layers,
                                  dtype_name, kept=eagle3.KEPT)


def hf_tensors(source: draft_source.DraftSource) -> dict:
    """All of the draft's HF tensors in memory (tests and small drafts)."""
    return dict(hf_stream(source)[1])


def write(directory, config: dict, tensors: dict, max_shard_mb=None):
    """config.json and the weights of a draft held in memory (a dict) into an existing
    directory: see `write_stream`."""
    specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    write_stream(directory, config, specs, iter(tensors.items()), max_shard_mb)


def write_stream(directory, config: dict, specs, stream, max_shard_mb=None):
    """config.json and model.safetensors (byte-reproducible) into an existing directory, one
    tensor at a time; with `max_shard_mb`, files of at most that size (tensors in `specs`
    order) and the index HF readers and the engines follow, when one file would be larger."""
    directory = Path(directory)
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    limit = None if max_shard_mb is None else int(max_shard_mb * 2**20)
    files.write_sharded(directory, specs, stream, limit, WEIGHTS, metadata={"format": "pt"})


def export_eagle3(ckpt_dir, out_dir, dtype=None, overwrite=False, max_shard_mb=None):
    """Write the EAGLE3 draft of a speculative or training checkpoint (any saved TP/PP) as an
    HF draft directory, one tensor at a time. `dtype`: float32 | bfloat16 | float16 (default:
    as trained); `max_shard_mb`: see `write_stream`. Nothing is written unless every tensor
    maps."""
    checkpoint.check_output_dir(out_dir, overwrite)
    source = draft_source.read_draft(ckpt_dir, "eagle3")
    specs, stream = hf_stream(source, dtype)
    config = hf_config(source.hf_config, source.cfg, dtype or source.meta["dtype"])
    with checkpoint.atomic_output(out_dir) as tmp:
        write_stream(tmp, config, specs, stream, max_shard_mb)
    return Path(out_dir)

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

from megatron_specdec import checkpoint, families
from megatron_specdec.export import draft_source
from megatron_specdec.weights import eagle3
# The layout's names and shapes live with its weight table; tests read them from here too.
from megatron_specdec.weights.eagle3 import layer_prefix, tensor_shapes  # noqa: F401

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
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
    # No `target_hidden_size`: the draft's hidden size is the base's, and the key would make
    # the EAGLE reference runtime expect the draft's own embed_tokens in the file.
    return config


def hf_tensors(source: draft_source.DraftSource) -> dict:
    cfg = source.cfg
    geo = eagle3.geometry(source.hf_config, source.meta["padding"], cfg)
    return draft_source.to_hf(eagle3.rules(cfg), source.tensors, geo, cfg.eagle_num_layers)


def write(directory, config: dict, tensors: dict, max_shard_mb=None):
    """config.json and model.safetensors into an existing directory (byte-reproducible); with
    `max_shard_mb`, files of at most that size (tensors in name order) and the index HF
    readers and the engines follow, when one file would be larger."""
    from safetensors.torch import save_file

    directory = Path(directory)
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    total = sum(sizes.values())
    limit = None if max_shard_mb is None else int(max_shard_mb * 2**20)
    if limit is None or total <= limit:
        save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
        return
    shards, current, filled = [], {}, 0
    for name in sorted(tensors):
        if current and filled + sizes[name] > limit:
            shards.append(current)
            current, filled = {}, 0
        current[name] = tensors[name]
        filled += sizes[name]
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total},
             "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def export_eagle3(ckpt_dir, out_dir, dtype=None, overwrite=False, max_shard_mb=None):
    """Write the EAGLE3 draft of a speculative or training checkpoint (any saved TP/PP) as an
    HF draft directory. `dtype`: float32 | bfloat16 | float16 (default: as trained);
    `max_shard_mb`: see `write`. Nothing is written unless every tensor maps."""
    checkpoint.check_output_dir(out_dir, overwrite)
    source = draft_source.read_draft(ckpt_dir, "eagle3")
    tensors = draft_source.cast(hf_tensors(source), dtype)
    config = hf_config(source.hf_config, source.cfg, dtype or source.meta["dtype"])
    tmp = checkpoint.atomic_dir(out_dir)
    try:
        write(tmp, config, tensors, max_shard_mb)
        checkpoint.commit_dir(tmp, out_dir, linked=False)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return Path(out_dir)

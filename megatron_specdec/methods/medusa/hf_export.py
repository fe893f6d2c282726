"""Medusa heads -> the original FasterDecoding Medusa layout.

Directory: `config.json` (`medusa_num_heads`, `medusa_num_layers`, `medusa_fc_bias`, `hidden_size`,
`vocab_size`) and `medusa_lm_head.safetensors` with `{i}.{j}.linear.weight/bias` (block j of
head i) and `{i}.{L}.weight` (head i's lm_head, unpadded [vocab, h]): what FasterDecoding's
MedusaModel and TensorRT-LLM's Medusa checkpoint converter read. vLLM's Medusa expects
another layout (docs/export.md).
"""

import json
from pathlib import Path

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.export import draft_source
from megatron_specdec.checkpointing import hf_files as files, hf_mapping as mapping
from megatron_specdec.methods.medusa import hf_weights as medusa

WEIGHTS = "medusa_lm_head.safetensors"
CONFIG = "config.json"


def hf_config(base, cfg, dtype_name: str) -> dict:
    return {
        "medusa_num_heads": cfg.medusa_num_heads,
        "medusa_num_layers": cfg.medusa_num_layers,
        "medusa_fc_bias": True,  # the blocks carry biases; vLLM builds them bias-free without it
        "hidden_size": base.hidden_size,
        "vocab_size": base.vocab_size,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def tensor_shapes(config: dict) -> dict:
    h, layers = config["hidden_size"], config["medusa_num_layers"]
    shapes = {}
    for i in range(config["medusa_num_heads"]):
        for j in range(layers):
            shapes[f"{i}.{j}.linear.weight"] = (h, h)
            shapes[f"{i}.{j}.linear.bias"] = (h,)
        shapes[f"{i}.{layers}.weight"] = (config["vocab_size"], h)
    return shapes


def export_medusa(ckpt_dir, out_dir, dtype=None, overwrite=False):
    """Write the Medusa heads of a speculative checkpoint (any saved TP/PP) in the
    FasterDecoding layout, one tensor at a time; nothing is written unless every tensor
    maps."""
    checkpoint.check_output_dir(out_dir, overwrite)
    source = draft_source.read_draft(ckpt_dir, "medusa")
    cfg = source.cfg
    geo = mapping.Geometry.from_hf(source.hf_config, source.meta["padding"])
    specs, stream = draft_source.hf_stream(medusa.rules(cfg), source, geo, cfg.medusa_num_heads,
                                           dtype)
    config = hf_config(source.hf_config, cfg, dtype or source.meta["dtype"])
    with checkpoint.atomic_output(out_dir) as tmp:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        files.write_sharded(tmp, specs, stream, weights_name=WEIGHTS, metadata={"format": "pt"})
    return Path(out_dir)

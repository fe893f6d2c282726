"""HF <-> Megatron tensor names for the mixture-of-experts families (Qwen3-MoE, Mixtral).

One declarative table per family, read both ways: attention as in the Llama table, then the
MoE block. `{i}` is the global layer index, `{e}` the global expert index. Megatron's MoE layer
keeps its norm apart (`pre_mlp_layernorm`), its router as `mlp.router`, and each expert's fc1
as `[gate; up]`; the Megatron expert names are the checkpoint's (experts stacked).
"""

from megatron_specdec.checkpointing import hf_llama as llama
from megatron_specdec.checkpointing.hf_mapping import Rule

_L = "decoder.layers.{i}."
_H = "model.layers.{i}."

# family name -> (HF prefix of the MoE block, HF names of an expert's gate, up, down)
_BLOCKS = {
    "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
}


def rules(family: str, tied_embeddings: bool = False):
    block, (gate, up, down) = _BLOCKS[family]
    expert = _H + block + "experts.{e}.%s.weight"
    attention = [r for r in llama.rules(tied_embeddings) if ".mlp." not in r.megatron]
    return attention + [
        Rule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",)),
        Rule(_L + "mlp.router.weight", (_H + block + "gate.weight",)),
        Rule(_L + "mlp.experts.experts.linear_fc1.weight", (expert % gate, expert % up),
             "gate_up", 0, experts=True),
        Rule(_L + "mlp.experts.experts.linear_fc2.weight", (expert % down,), tp_dim=1,
             experts=True),
    ]


def disk_shapes(family: str, shapes: dict) -> dict:
    """{name: shape} of a transformers model in memory (experts fused: `mlp.experts.gate_up_proj`
    [E, 2F, H], `mlp.experts.down_proj` [E, H, F], router `mlp.gate`) -> the per-expert names and
    shapes its checkpoints hold on disk, which the table reads."""
    block, (gate, up, down) = _BLOCKS[family]
    out = {}
    for name, shape in shapes.items():
        head, sep, tail = name.partition(".mlp.")
        if not sep:
            out[name] = tuple(shape)
            continue
        prefix = f"{head}.{block}"
        if tail == "experts.gate_up_proj":
            for e in range(shape[0]):
                out[f"{prefix}experts.{e}.{gate}.weight"] = (shape[1] // 2, shape[2])
                out[f"{prefix}experts.{e}.{up}.weight"] = (shape[1] // 2, shape[2])
        elif tail == "experts.down_proj":
            for e in range(shape[0]):
                out[f"{prefix}experts.{e}.{down}.weight"] = tuple(shape[1:])
        else:
            out[prefix + tail] = tuple(shape)
    return out

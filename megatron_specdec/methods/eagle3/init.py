"""Initial weights of an EAGLE3 draft that do not depend on the TP layout.

Megatron draws each TP rank's shard from that rank's own random stream, and a base imported
at another TP has another number of zero-padded query groups (SmolLM2: 3 at TP=1, 4 at TP=2),
so one seed gave different drafts, and different losses, at TP=1 and TP=2. Here every tensor
is drawn once in the HF layout (unpadded, unsharded) from one generator, then padded and split
by the same declarative table an import uses: padded query groups and padded lm_head rows
start at zero on every layout. Padded rows are masked to -inf, so they never train and stay
zero, which keeps import(export(x)) == x (export drops them, import fills zeros).
"""

import math

import torch
from megatron.core import parallel_state as ps

from megatron_specdec.methods.eagle3 import hf_weights as eagle3
from megatron_specdec.checkpointing import hf_mapping as mapping

# Residual-branch outputs get megatron's scaled init (std / sqrt(2 * num_layers)).
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


def draft_geometry(config, cfg, real_query_groups: int) -> mapping.Geometry:
    """Geometry of a draft built on a base whose megatron config may carry padded groups."""
    heads_per_group = config.num_attention_heads // config.num_query_groups
    base = mapping.Geometry(
        num_heads=real_query_groups * heads_per_group, num_groups=real_query_groups,
        head_dim=config.kv_channels, vocab_size=0, padded_vocab_size=0,
        padded_groups=config.num_query_groups,
    )
    return eagle3.with_draft_vocab(base, cfg)


def hf_initial_state(config, cfg, geo: mapping.Geometry, vocab_size: int, seed: int) -> dict:
    """HF-named initial tensors of the draft (identity draft vocabulary)."""
    shapes = eagle3.tensor_shapes({
        "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "head_dim": geo.head_dim, "num_attention_heads": geo.num_heads,
        "num_key_value_heads": geo.num_groups, "num_hidden_layers": cfg.eagle_num_layers,
        "draft_vocab_size": cfg.draft_vocab_size, "vocab_size": vocab_size,
        "parallel_drafting": cfg.parallel_drafting,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": cfg.aux_layer_ids,
            "use_last_layernorm": cfg.use_last_layernorm,
            "use_input_layernorm_in_first_layer": cfg.use_input_layernorm_in_first_layer,
        },
    })
    generator = torch.Generator().manual_seed(seed)
    std = config.init_method_std
    out_std = std / math.sqrt(2.0 * config.num_layers)
    state = {}
    for name in sorted(shapes):  # fixed draw order
        shape = shapes[name]
        if name == "d2t":
            state[name] = torch.zeros(shape, dtype=torch.int64)
        elif name == "t2d":
            state[name] = torch.arange(shape[0]) < cfg.draft_vocab_size
        elif name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        else:
            scale = out_std if name.endswith(_OUTPUT_PROJECTIONS) else std
            state[name] = torch.randn(shape, generator=generator) * scale
    return state


@torch.no_grad()
def initialize_draft(draft, config, cfg, real_query_groups: int, vocab_size: int, seed: int):
    """Overwrite every parameter and buffer of this rank's draft with its TP-independent init."""
    geo = draft_geometry(config, cfg, real_query_groups)
    rules = eagle3.rules(cfg)
    state = mapping.hf_to_megatron(rules, hf_initial_state(config, cfg, geo, vocab_size, seed),
                                   geo, cfg.eagle_num_layers)
    mapping.load_into_model(draft, rules, state, cfg.eagle_num_layers, 0,
                            ps.get_tensor_model_parallel_rank(),
                            ps.get_tensor_model_parallel_world_size(), kept=eagle3.KEPT)

"""Megatron <-> HF tensor names of the EAGLE3 draft module (LlamaForCausalLMEagle3 layout).

Megatron names are relative to the draft module; in a checkpoint they carry the prefix
`eagle3.`. A one-layer draft is `midlayer.*` in HF, a multi-layer draft `layers.{i}.*`.
The first layer's q/k/v read the 2h concatenation [embedding, hidden], so their HF weights
are [.., 2h]; the `qkv` rule interleaves them per query group like the base's.
"""

import dataclasses

from megatron_specdec.checkpointing.hf_mapping import Geometry, Rule

CHECKPOINT_PREFIX = "eagle3."


def rules(cfg):
    """`cfg`: an Eagle3Config."""
    single = cfg.eagle_num_layers == 1
    meg, hf = ("layers.0.", "midlayer.") if single else ("layers.{i}.", "layers.{i}.")
    return [
        Rule("fc.weight", ("fc.weight",)),
        # Absent when use_input_layernorm_in_first_layer is false (first layer only).
        Rule(meg + "input_layernorm.weight", (hf + "input_layernorm.weight",), optional=True),
        Rule("layers.0.hidden_norm.weight",
             (("midlayer." if single else "layers.0.") + "hidden_norm.weight",)),
        Rule(meg + "self_attention.linear_qkv.weight",
             (hf + "self_attn.q_proj.weight", hf + "self_attn.k_proj.weight",
              hf + "self_attn.v_proj.weight"), "qkv", 0),
        Rule(meg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",),
             "heads_in", 1),
        Rule(meg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
        Rule(meg + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
             "gate_up", 0),
        Rule(meg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), tp_dim=1),
        Rule("final_layernorm.weight", ("norm.weight",), optional=not cfg.use_last_layernorm),
        Rule("lm_head.weight", ("lm_head.weight",), "vocab", 0),
        Rule("d2t", ("d2t",)),
        Rule("t2d", ("t2d",)),
    ] + ([Rule("mask_hidden", ("mask_hidden",))] if cfg.parallel_drafting else [])


# Set from the base when the draft is attached (layers.Eagle3Module): no HF tensor holds it.
KEPT = ("mask_embed",)


def geometry(hf_config, padding: dict, cfg) -> Geometry:
    """Shapes of the draft: the base's heads (and padded query groups), the draft vocabulary."""
    return with_draft_vocab(Geometry.from_hf(hf_config, padding), cfg)


def with_draft_vocab(base: Geometry, cfg) -> Geometry:
    """The draft's geometry from its base's: same heads and groups, the draft vocabulary."""
    return dataclasses.replace(base, vocab_size=cfg.draft_vocab_size,
                               padded_vocab_size=cfg.padded_draft_vocab_size)


def layer_prefix(num_layers: int, layer: int) -> str:
    return "midlayer." if num_layers == 1 else f"layers.{layer}."


def tensor_shapes(config: dict) -> dict:
    """HF tensor name -> shape of every tensor a draft described by `config` holds."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layers = config["num_hidden_layers"]
    eagle = config.get("eagle_config") or {}
    num_aux = len(eagle.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    target_h = config.get("target_hidden_size", h)
    shapes = {"fc.weight": (h, num_aux * target_h),
              "lm_head.weight": (config["draft_vocab_size"], h),
              "d2t": (config["draft_vocab_size"],), "t2d": (config["vocab_size"],)}
    if eagle.get("use_last_layernorm", True):
        shapes["norm.weight"] = (h,)
    if config.get("parallel_drafting"):
        shapes["mask_hidden"] = (1, num_aux * target_h)
    for i in range(layers):
        p, width = layer_prefix(layers, i), (2 * h if i == 0 else h)
        shapes.update({
            p + "self_attn.q_proj.weight": (q, width), p + "self_attn.k_proj.weight": (kv, width),
            p + "self_attn.v_proj.weight": (kv, width), p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if i or eagle.get("use_input_layernorm_in_first_layer", True):
            shapes[p + "input_layernorm.weight"] = (h,)
        if i == 0:
            shapes[p + "hidden_norm.weight"] = (h,)
    return shapes

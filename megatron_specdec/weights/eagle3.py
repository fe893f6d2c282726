"""Megatron <-> HF tensor names of the EAGLE3 draft module (LlamaForCausalLMEagle3 layout).

Megatron names are relative to the draft module; in a checkpoint they carry the prefix
`eagle3.`. A one-layer draft is `midlayer.*` in HF, a multi-layer draft `layers.{i}.*`.
The first layer's q/k/v read the 2h concatenation [embedding, hidden], so their HF weights
are [.., 2h]; the `qkv` rule interleaves them per query group like the base's.
"""

import dataclasses

from megatron_specdec.weights.mapping import Geometry, Rule

CHECKPOINT_PREFIX = "eagle3."


def rules(cfg):
    """`cfg`: spec_config.Eagle3Config."""
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
    ]


def geometry(hf_config, padding: dict, cfg) -> Geometry:
    """Shapes of the draft: the base's heads (and padded query groups), the draft vocabulary."""
    return with_draft_vocab(Geometry.from_hf(hf_config, padding), cfg)


def with_draft_vocab(base: Geometry, cfg) -> Geometry:
    """The draft's geometry from its base's: same heads and groups, the draft vocabulary."""
    return dataclasses.replace(base, vocab_size=cfg.draft_vocab_size,
                               padded_vocab_size=cfg.padded_draft_vocab_size)

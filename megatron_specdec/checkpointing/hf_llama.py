"""HF <-> Megatron tensor names for the Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3).

One declarative table, read both ways. `{i}` is the global layer index. Optional rows exist
only in some families: q/k/v biases (Qwen2), q/k norms (Qwen3), lm_head (untied models).
"""

from megatron_specdec.checkpointing.hf_mapping import Rule

_L = "decoder.layers.{i}."
_H = "model.layers.{i}."



def rules(tied_embeddings: bool = False):
    """Megatron names are the dist-checkpoint names, which are Transformer Engine's for both
    layer specs (the local spec maps its norms onto TE's fused LayerNormLinear names)."""
    table = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0),
        Rule(_L + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",)),
        Rule(
            _L + "self_attention.linear_qkv.weight",
            (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight",
             _H + "self_attn.v_proj.weight"),
            "qkv", 0,
        ),
        Rule(
            _L + "self_attention.linear_qkv.bias",
            (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias",
             _H + "self_attn.v_proj.bias"),
            "qkv", 0, optional=True,
        ),
        Rule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",),
             optional=True),
        Rule(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",),
             optional=True),
        Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",),
             "heads_in", 1),
        Rule(_L + "mlp.linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",)),
        Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
             "gate_up", 0),
        Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), tp_dim=1),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    # Tied models keep one tensor in HF; the last pipeline stage's output_layer is a copy of it.
    lm_head = "model.embed_tokens.weight" if tied_embeddings else "lm_head.weight"
    table.append(Rule("output_layer.weight", (lm_head,), "vocab", 0, optional=tied_embeddings))
    return table

"""Supported Hugging Face model families and their translation to a Megatron TransformerConfig.

One entry per architecture; everything family-specific (qkv bias, q/k norm) is a field here,
so the provider and the weight table stay family-agnostic.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections only
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys


FAMILIES = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True),
}


class UnsupportedModelError(ValueError):
    pass


def family_of(hf_config) -> Family:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        # Configs built in code (tests, GGUF) may lack `architectures`: use model_type.
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        arch = by_type.get(getattr(hf_config, "model_type", None))
        archs = [arch] if arch else [f"model_type={getattr(hf_config, 'model_type', None)}"]
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise UnsupportedModelError(
        f"unsupported architecture {archs[0]!r}; supported: {', '.join(sorted(FAMILIES))}"
    )


def _field(hf_config, name, default=None):
    return getattr(hf_config, name, default)


def head_dim(hf_config) -> int:
    return _field(hf_config, "head_dim") or hf_config.hidden_size // hf_config.num_attention_heads


def rope_settings(hf_config) -> dict:
    """RoPE keyword arguments for GPTModel, from `rope_parameters` (transformers 5) or
    `rope_theta`/`rope_scaling` (older configs). Unsupported scalings are refused by name."""
    params = dict(_field(hf_config, "rope_parameters") or {})
    scaling = dict(_field(hf_config, "rope_scaling") or params)
    theta = params.get("rope_theta", _field(hf_config, "rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    kwargs = {"position_embedding_type": "rope", "rotary_base": theta}
    if rope_type == "default":
        return kwargs
    if rope_type == "linear":
        kwargs["seq_len_interpolation_factor"] = scaling["factor"]
        return kwargs
    if rope_type == "llama3":
        # megatron-core implements the Llama 3.x scaling with these fixed constants only.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(scaling.get(key, value)) != value:
                raise UnsupportedModelError(
                    f"rope_scaling.{key}={scaling[key]} is not supported (megatron-core implements "
                    f"llama3 scaling with {key}={value})"
                )
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
        return kwargs
    raise UnsupportedModelError(
        f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


def _check_sliding_window(hf_config):
    window = _field(hf_config, "sliding_window")
    uses = _field(hf_config, "use_sliding_window", True)
    if window and uses and window < hf_config.max_position_embeddings:
        raise UnsupportedModelError(
            f"sliding_window={window} (< max_position_embeddings="
            f"{hf_config.max_position_embeddings}) is not supported; use a full-attention model"
        )


def query_groups(hf_config) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def padded_query_groups(hf_config, tp: int) -> int:
    """Query groups rounded up to a multiple of TP. The extra groups have zero q/k/v and
    zero output-projection columns, so they add exactly nothing (SmolLM2: 3 groups, TP=2)."""
    groups = query_groups(hf_config)
    return -(-groups // tp) * tp


def transformer_config(hf_config, tp: int = 1, pp: int = 1, dtype=torch.float32,
                       num_query_groups=None, **overrides):
    """A megatron-core TransformerConfig equivalent to `hf_config`; `num_query_groups` is the
    padded group count (default: padded for `tp`)."""
    from megatron.core.transformer import TransformerConfig

    from megatron_specdec import cpu_compat

    family = family_of(hf_config)
    _check_sliding_window(hf_config)
    if hf_config.num_hidden_layers % pp != 0:
        raise ValueError(
            f"num_hidden_layers={hf_config.num_hidden_layers} is not divisible by pipeline_parallel={pp}"
        )
    groups = num_query_groups or padded_query_groups(hf_config, tp)
    if groups % tp != 0 or groups < query_groups(hf_config):
        raise ValueError(
            f"{groups} (padded) query groups cannot be split over tensor_parallel={tp}; "
            f"re-import the model at tensor_parallel={tp}"
        )
    heads_per_group = hf_config.num_attention_heads // query_groups(hf_config)
    if _field(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf_config.hidden_act!r}; only 'silu' (SwiGLU)")
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=groups * heads_per_group,
        num_query_groups=groups,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=_field(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if not torch.cuda.is_available():
        kwargs.update(cpu_compat.CPU_UNFUSED_CONFIG)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)

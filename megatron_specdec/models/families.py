"""Supported Hugging Face model families and their translation to a Megatron TransformerConfig.

One entry per architecture; everything family-specific (qkv bias, q/k norm, mixture of experts
and its router) is a field here, so the provider and the weight table stay family-agnostic.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False  # Qwen2: bias on q/k/v projections only
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys
    moe: bool = False  # every layer's MLP is a routed mixture of SwiGLU experts


FAMILIES = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", qk_norm=True, moe=True),
    "MixtralForCausalLM": Family("mixtral", moe=True),
}


class UnsupportedModelError(ValueError):
    pass


def family_of(hf_config) -> Family:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        # Configs built in code (tests, GGUF) may lack `architectures`: use model_type.
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                   "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
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


def num_experts(hf_config) -> int:
    """Routed experts per MoE layer (0 for a dense family)."""
    if not family_of(hf_config).moe:
        return 0
    return _field(hf_config, "num_experts") or _field(hf_config, "num_local_experts")


def moe_settings(hf_config, ep: int = 1, etp=None) -> dict:
    """TransformerConfig fields of a mixture-of-experts family at expert parallel size `ep`.

    Routing equals HF's: megatron's `moe_router_pre_softmax=False` takes the top-k logits and
    softmaxes over those k, which is HF's softmax-top-k-renormalise (Mixtral always,
    Qwen3-MoE with `norm_topk_prob`); `True` softmaxes over all experts and keeps the top-k
    probabilities unnormalised (Qwen3-MoE without it). The base is frozen under a draft: no
    load-balancing loss, no aux loss. Experts are SequentialMLP fed by the all-gather
    dispatcher, the pair that runs on gloo as on NCCL."""
    family = family_of(hf_config)
    experts = num_experts(hf_config)
    if ep < 1 or experts % ep:
        raise ValueError(
            f"expert_parallel={ep} does not divide the {experts} experts of {family.name}"
        )
    topk = hf_config.num_experts_per_tok
    renormalise = family.name == "mixtral" or bool(_field(hf_config, "norm_topk_prob", False))
    if topk == 1 and renormalise:
        raise UnsupportedModelError(
            f"num_experts_per_tok=1 with renormalised top-k: megatron's softmax over one logit "
            f"is always 1; only unnormalised top-1 (norm_topk_prob=false) is supported"
        )
    sparse_step = _field(hf_config, "decoder_sparse_step", 1)
    if list(_field(hf_config, "mlp_only_layers", None) or []) or sparse_step != 1:
        # A dense/MoE mix stores per-layer checkpoint keys the streaming readers do not address.
        raise UnsupportedModelError(
            f"mlp_only_layers={hf_config.mlp_only_layers} / decoder_sparse_step={sparse_step}: "
            f"only models whose every layer is MoE are supported"
        )
    if _field(hf_config, "router_jitter_noise", 0.0):
        raise UnsupportedModelError(
            f"router_jitter_noise={hf_config.router_jitter_noise}; only 0 (deterministic routing)"
        )
    return dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=_field(hf_config, "moe_intermediate_size")
        or hf_config.intermediate_size,
        moe_router_topk=topk,
        moe_router_pre_softmax=not renormalise,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None,  # neither family has shared experts
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def transformer_config(hf_config, tp: int = 1, pp: int = 1, dtype=torch.float32,
                       num_query_groups=None, ep: int = 1, etp=None, **overrides):
    """A megatron-core TransformerConfig equivalent to `hf_config`; `num_query_groups` is the
    padded group count (default: padded for `tp`); `ep`/`etp`: expert parallel and expert
    tensor parallel sizes of an MoE family (etp None: `tp`)."""
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
    if family.moe:
        kwargs.update(moe_settings(hf_config, ep, tp if etp is None else etp))
    elif ep != 1:
        raise ValueError(f"expert_parallel={ep} given for the dense family {family.name}")
    if not torch.cuda.is_available():
        kwargs.update(cpu_compat.CPU_UNFUSED_CONFIG)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)

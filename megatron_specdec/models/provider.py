"""GPT model provider: a megatron-core GPTModel built from a Hugging Face config.

`make_model_provider(hf_config, ...)` returns a function with Megatron's
`model_provider(pre_process, post_process)` shape; `build_model` calls it for this rank's
pipeline stage. The layer spec is the Transformer Engine one when TE imports on a GPU and
the local (pure megatron-core) one otherwise; TE's absence is never an error.
"""

import torch

from megatron_specdec.models import families

TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary so that every TP rank holds an equal multiple of 128."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def default_padding(hf_config, tp: int) -> dict:
    return {
        "query_groups": families.padded_query_groups(hf_config, tp),
        "vocab_size": padded_vocab_size(hf_config.vocab_size, tp),
    }


def resolve_transformer_impl(impl: str = "auto") -> str:
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl={impl!r}; expected one of {TRANSFORMER_IMPLS}")
    if impl != "auto":
        return impl
    if not torch.cuda.is_available():
        return "local"
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return "local"
    return "transformer_engine"


def layer_spec(config, impl: str):
    """megatron-core's GPT layer spec for `impl` with the decoding attention of
    models/layers/decode_attention.py (rotated-key cache, caller's mask applied); the local spec
    also takes the small-row linears and SDPA core attention (models/layers/small_rows_linear.py),
    and a dense layer the lean decoding forward (models/layers/decode_layer.py).
    Parameter names and shapes are megatron's own."""
    from dataclasses import replace

    from megatron.core.models.gpt import gpt_layer_specs

    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_specdec.models.layers.decode_attention import DecodeSelfAttention, SDPAttention
    from megatron_specdec.models.layers.decode_layer import DecodeTransformerLayer
    from megatron_specdec.models.layers.small_rows_linear import (
        SmallRowsColumnParallelLinear,
        SmallRowsRowParallelLinear,
    )

    # An MoE config (every layer MoE, families.moe_settings) takes megatron's MoELayer with
    # SequentialMLP experts on both specs: one checkpoint layout, and it runs on gloo.
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if impl == "transformer_engine":
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm, **moe
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=config.qk_layernorm, normalization="RMSNorm", **moe
        )
    layer = spec.submodules
    attention = replace(layer.self_attention, module=DecodeSelfAttention)
    mlp = layer.mlp
    if impl != "transformer_engine":
        attention = replace(attention, submodules=replace(
            attention.submodules, linear_qkv=SmallRowsColumnParallelLinear,
            core_attention=SDPAttention, linear_proj=SmallRowsRowParallelLinear))
    if impl != "transformer_engine" and not config.num_moe_experts:
        mlp = replace(mlp, submodules=replace(
            mlp.submodules, linear_fc1=SmallRowsColumnParallelLinear,
            linear_fc2=SmallRowsRowParallelLinear))
    if config.num_moe_experts:
        # The local spec checkpoints an MoE layer's own norm under the dense fused name
        # (`mlp.linear_fc1.layer_norm_weight`), TE's as `pre_mlp_layernorm.weight`: keep
        # TE's, so both specs read and write one layout.
        keys = {k: v for k, v in layer.sharded_state_dict_keys_map.items()
                if k != "pre_mlp_layernorm."}
        layer = replace(layer, sharded_state_dict_keys_map=keys)
    module = DecodeTransformerLayer if spec.module is TransformerLayer else spec.module
    return replace(spec, module=module,
                   submodules=replace(layer, self_attention=attention, mlp=mlp))


def make_model_provider(hf_config, tp=1, pp=1, dtype=torch.float32, transformer_impl="auto",
                        max_sequence_length=None, padding=None, pg_collection=None, ep=1,
                        etp=None, **config_overrides):
    """A `model_provider(pre_process, post_process, vp_stage=None)` for `hf_config`.

    `padding` ({"query_groups", "vocab_size"}) is the padding a checkpoint was saved with;
    by default the padding for `tp`. `pg_collection`: the model's process groups (default:
    megatron's global ones).
    """
    from megatron.core.models.gpt import GPTModel

    padding = padding or default_padding(hf_config, tp)
    if padding["vocab_size"] % tp:
        raise ValueError(
            f"padded vocabulary {padding['vocab_size']} cannot be split over tensor_parallel={tp}"
        )
    impl = resolve_transformer_impl(transformer_impl)
    config = families.transformer_config(
        hf_config, tp=tp, pp=pp, dtype=dtype, num_query_groups=padding["query_groups"],
        ep=ep, etp=etp, transformer_impl=impl, **config_overrides,
    )
    rope = families.rope_settings(hf_config)

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        return _norms_in_params_dtype(GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, impl),
            vocab_size=padding["vocab_size"],
            max_sequence_length=max_sequence_length or hf_config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=bool(
                getattr(hf_config, "tie_word_embeddings", False)
            ),
            vp_stage=vp_stage,
            pg_collection=pg_collection,
            **rope,
        ), config.params_dtype)

    model_provider.config = config
    model_provider.padding = padding
    model_provider.transformer_impl = impl
    return model_provider


def _norms_in_params_dtype(model, dtype: torch.dtype):
    """The local spec's norms (megatron's WrappedTorchNorm: torch's RMSNorm/LayerNorm) are
    built in fp32 whatever params_dtype is (megatron's trainer casts the whole model later);
    in a bf16 model torch's rms_norm then sees a bf16 input and an fp32 weight, cannot use its
    fused kernel and warns. They take the model's dtype, as every other parameter has (no-op
    in fp32; TE's norms already follow params_dtype)."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype)
    return model


def build_model(hf_config, dtype=torch.float32, transformer_impl="auto", padding=None,
                **config_overrides):
    """This rank's stage of the GPTModel, on the current device, for the initialised TP/PP
    (and, for an MoE family, EP and expert TP) groups."""
    from megatron.core import parallel_state as ps

    from megatron_specdec.distributed import device

    moe = families.family_of(hf_config).moe
    provider = make_model_provider(
        hf_config,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size() if moe else 1,
        etp=ps.get_expert_tensor_parallel_world_size() if moe else None,
        dtype=dtype,
        transformer_impl=transformer_impl,
        padding=padding,
        **config_overrides,
    )
    model = provider(
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
    )
    model.padding = provider.padding
    return model.to(device())

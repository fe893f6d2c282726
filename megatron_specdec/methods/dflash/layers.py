"""The DFlash draft module (vLLM's DFlashDraftModel), from megatron-core parallel layers.

Context: the base's captured residual streams, concatenated, through `fc` (replicated over
TP, n_aux*h -> h) and `hidden_norm`. Each draft layer projects that context with its own
q/k/v linear (the query part is unused) into keys and values only: the context never runs
through a layer's residual stream. The query block (the anchor token's embedding, then the
trained mask embedding) runs through Qwen3-style pre-norm layers with per-head q/k RMSNorm,
attending to the context keys and to its own block through an explicit mask, then the
final norm; logits come from the base's output layer (shared, as vLLM shares `lm_head`).
"""

from dataclasses import dataclass, field
from typing import List, Optional, Union

import torch
from torch import Tensor

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_specdec.models.layers.decode_attention import SDPAttention
from megatron_specdec.models.layers.sharded import ShardedModuleList
from megatron_specdec.models.layers.small_rows_linear import (
    SmallRowsColumnParallelLinear,
    SmallRowsRowParallelLinear,
    rows_linear,
)


class HeadRMSNorm(torch.nn.RMSNorm):
    """Qwen3's per-head q/k RMSNorm. Its weight is replicated over TP but each rank sees only
    its own heads, so the weight's gradient is summed over the TP group (megatron's
    copy-to-region: identity forward, all-reduce backward); megatron's own q/k norms leave
    that to finalize_model_grads, which this trainer does not run."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)

    def forward(self, x: Tensor) -> Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight)
        return torch.nn.functional.rms_norm(x, self.normalized_shape, weight, self.eps)


class DFlashAttention(SelfAttention):
    """Block queries over [context keys; block keys]. The context's keys/values come from this
    layer's own q/k/v linear over the projected context (`context_kv`); in training they are
    passed in, in drafting they sit in a DecodeCache at slot = position. `attention_mask`
    [b, 1, q, keys] is True where a query may not attend."""

    def context_kv(self, context: Tensor, rotary: Optional[Tensor]):
        """(keys, values) [s, b, groups, head_dim] of context states [s, b, h] (keys rotated
        to their positions; the query part of the projection is unused)."""
        _, key, value = self.get_query_key_value_tensors(context)
        if rotary is not None:
            key = apply_rotary_pos_emb(key, rotary, config=self.config)
        return key, value

    def forward(self, hidden_states: Tensor, block_rotary: Optional[Tensor],
                attention_mask: Tensor, context_kv=None, cache=None) -> Tensor:
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if block_rotary is not None:
            query = apply_rotary_pos_emb(query, block_rotary, config=self.config)
            key = apply_rotary_pos_emb(key, block_rotary, config=self.config)
        if cache is not None:
            keys, values = cache.append(self.layer_number, key, value)
        else:
            keys = torch.cat([context_kv[0], key]).contiguous()
            values = torch.cat([context_kv[1], value]).contiguous()
        out = self.core_attention(query, keys, values, attention_mask,
                                  attn_mask_type=AttnMaskType.arbitrary)
        out, bias = self.linear_proj(out)
        return out if bias is None else out + bias


@dataclass
class DFlashLayerSubmodules:
    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp


class DFlashLayer(MegatronModule):
    """A Qwen3 decoder layer whose attention also reads the projected context."""

    def __init__(self, config, submodules: DFlashLayerSubmodules, layer_number: int = 1):
        super().__init__(config=config)
        norm_args = dict(config=config, hidden_size=config.hidden_size,
                         eps=config.layernorm_epsilon)
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_args)
        self.self_attention = build_module(submodules.self_attention, config=config,
                                           layer_number=layer_number)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_args)
        self.mlp = build_module(submodules.mlp, config=config)

    def forward(self, hidden_states, block_rotary, attention_mask, context_kv=None, cache=None):
        hidden_states = hidden_states + self.self_attention(
            self.input_layernorm(hidden_states), block_rotary, attention_mask, context_kv, cache)
        out, bias = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return hidden_states + (out if bias is None else out + bias)


@dataclass
class DFlashModuleSubmodules:
    layers: List[ModuleSpec] = field(default_factory=list)
    hidden_norm: Union[ModuleSpec, type] = IdentityOp
    final_layernorm: Union[ModuleSpec, type] = IdentityOp


class DFlashModule(MegatronModule):
    def __init__(self, config, submodules: DFlashModuleSubmodules, num_aux: int):
        super().__init__(config=config)
        h = config.hidden_size
        norm_args = dict(config=config, hidden_size=h, eps=config.layernorm_epsilon)
        self.fc = torch.nn.Linear(num_aux * h, h, bias=False, dtype=config.params_dtype)
        self.hidden_norm = build_module(submodules.hidden_norm, **norm_args)
        self.layers = ShardedModuleList(
            build_module(spec, config=config, layer_number=i + 1)
            for i, spec in enumerate(submodules.layers))
        self.final_layernorm = build_module(submodules.final_layernorm, **norm_args)
        # The mask positions' input: trained (exported as vLLM's mask_embedding.pt), since the
        # base's row of any spare token carries nothing a draft could read.
        self.mask_embedding = torch.nn.Parameter(torch.zeros(h, dtype=config.params_dtype))

    def context(self, aux: Tensor) -> Tensor:
        """Captured base states [s, b, n_aux*h] -> the layers' context input [s, b, h] (`fc`
        through the few-row product when drafting: rows_linear is F.linear otherwise)."""
        return self.hidden_norm(rows_linear(aux, self.fc.weight))

    def block_inputs(self, anchor_embeds: Tensor, block_size: int) -> Tensor:
        """[n, b, h] anchor embeddings -> [n*block_size, b, h]: each anchor then block_size-1
        mask embeddings (block-major)."""
        n, b, h = anchor_embeds.shape
        masks = self.mask_embedding.to(anchor_embeds.dtype).expand(n, block_size - 1, b, h)
        return torch.cat([anchor_embeds[:, None], masks], dim=1).reshape(n * block_size, b, h)

    def forward(self, block_embeds: Tensor, context: Tensor, block_rotary: Optional[Tensor],
                context_rotary: Optional[Tensor], attention_mask: Tensor) -> Tensor:
        """Block inputs [q, b, h] and context [s, b, h] -> final hidden states [q, b, h]."""
        hidden = block_embeds
        for layer in self.layers:
            kv = layer.self_attention.context_kv(context, context_rotary)
            hidden = layer(hidden, block_rotary, attention_mask, context_kv=kv)
        return self.final_layernorm(hidden)

    def cache_context(self, context: Tensor, rotary: Optional[Tensor], cache) -> None:
        """Write every layer's context keys/values of context [s, b, h] at the cache's placed
        slots (drafting)."""
        for layer in self.layers:
            attention = layer.self_attention
            cache.append(attention.layer_number, *attention.context_kv(context, rotary))

    def decode(self, block_embeds: Tensor, block_rotary: Optional[Tensor],
               attention_mask: Tensor, cache) -> Tensor:
        """`forward` over a cache holding the context (drafting): the block's keys/values
        go to the cache's placed slots."""
        hidden = block_embeds
        for layer in self.layers:
            hidden = layer(hidden, block_rotary, attention_mask, cache=cache)
        return self.final_layernorm(hidden)


def dflash_layer_spec() -> ModuleSpec:
    backend = LocalSpecProvider()
    norm = backend.layer_norm(rms_norm=True)
    qk_norm = HeadRMSNorm
    attention = ModuleSpec(
        module=DFlashAttention,
        params={"attn_mask_type": AttnMaskType.arbitrary},
        submodules=SelfAttentionSubmodules(
            linear_qkv=SmallRowsColumnParallelLinear, core_attention=SDPAttention,
            linear_proj=SmallRowsRowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm),
    )
    return ModuleSpec(
        module=DFlashLayer,
        submodules=DFlashLayerSubmodules(
            input_layernorm=norm, self_attention=attention, pre_mlp_layernorm=norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=SmallRowsColumnParallelLinear, linear_fc2=SmallRowsRowParallelLinear)),
        ),
    )


def dflash_module_spec(cfg) -> ModuleSpec:
    """`cfg`: config.DFlashConfig."""
    norm = LocalSpecProvider().layer_norm(rms_norm=True)
    return ModuleSpec(
        module=DFlashModule,
        submodules=DFlashModuleSubmodules(
            layers=[dflash_layer_spec() for _ in range(cfg.num_layers)],
            hidden_norm=norm, final_layernorm=norm),
    )


def block_attention_mask(anchors: Tensor, block_size: int, context_len: int,
                         base_mask: Optional[Tensor] = None) -> Tensor:
    """[b, 1, n*B, s + n*B] bool, True = may not attend, for blocks at `anchors` [b, n]:
    a block sees the context positions before its anchor (and, with a packed base mask
    [b|1, 1, s, s], only those its anchor may see) and every position of its own block."""
    b, n = anchors.shape
    j = torch.arange(context_len, device=anchors.device)
    ctx_ok = j[None, None] < anchors[..., None]  # [b, n, s]
    if base_mask is not None:
        rows = base_mask[:, 0].expand(b, -1, -1).gather(
            1, anchors[..., None].expand(b, n, context_len))
        ctx_ok = ctx_ok & ~rows
    ctx_ok = ctx_ok.repeat_interleave(block_size, dim=1)  # [b, n*B, s]
    blk = torch.arange(n * block_size, device=anchors.device) // block_size
    blk_ok = (blk[:, None] == blk[None, :]).expand(b, -1, -1)
    return ~torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]

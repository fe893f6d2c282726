"""The EAGLE3 draft decoder layer, built from megatron-core parallel layers.

The first draft layer reads two streams: the embedding of the next token and the draft's
hidden state. Its q/k/v projections take their normalised concatenation
`cat([input_layernorm(embed), hidden_norm(hidden)])` (embedding first, 2h wide), while the
residual is the un-normalised hidden state. Later layers are ordinary pre-norm layers over
h. Attention runs over an explicit list of key/value blocks so the same code serves
training-time test (one block per unrolled step). Drafting at inference (no grad, the
drafter's DecodeCache) takes `Eagle3Layer.decode` where the layer allows it: the base's decoding
ops (models/layers/decode_layer.py) without megatron's per-call machinery, about a fifth of a
one-layer draft step on a 2-core CPU (bench/bench_decode_step.py --draft); for a batch-1 chain,
the whole layer as the base's one decode_layers op, its attention reading the embedding and the
hidden stream.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_specdec.models.layers.decode_attention import DecodeCache, DecodeSelfAttention
from megatron_specdec.models.layers.decode_layer import (
    LayerOp,
    decode_chain,
    fused_norm,
    fused_silu,
    lean_mlp,
    mlp_decode,
    norm_decode,
    norm_eps,
    residual_add,
)
from megatron_specdec.models.layers.small_rows_linear import SmallRowsColumnParallelLinear
from megatron_specdec.models.weight_memory import streamed
from megatron_specdec.methods.eagle3.ttt_attention import TTTMask, ttt_attention

KVBlocks = List[Tuple[Tensor, Tensor]]  # one (key, value) [s, b, groups, head_dim] per step


class Eagle3QKVLinear(SmallRowsColumnParallelLinear):
    """q/k/v projection of the first draft layer: its input is the 2h concatenation of the
    normalised embedding and normalised hidden state (SelfAttention asks for h)."""

    def __init__(self, input_size: int, output_size: int, **kwargs):
        super().__init__(2 * input_size, output_size, **kwargs)


class Eagle3Attention(DecodeSelfAttention):
    """Self-attention whose keys/values accumulate in a caller-owned block list.

    Each call appends this call's (rotated) keys and values to `kv_blocks` and attends over
    all blocks with an explicit boolean mask [b|1, 1, s_q, s_kv] (True = may not attend), or,
    in training-time test, a `TTTMask` (the same attention in memory linear in s). Drafting
    takes DecodeSelfAttention.decode instead (Eagle3Layer.decode).
    """

    def forward(self, hidden_states: Tensor, rotary_pos_emb: Optional[Tensor],
                attention_mask: Union[Tensor, TTTMask], kv_blocks: KVBlocks) -> Tensor:
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            query = apply_rotary_pos_emb(query, rotary_pos_emb, config=self.config)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, config=self.config)
        kv_blocks.append((key, value))
        if isinstance(attention_mask, TTTMask):
            dropout = self.config.attention_dropout if self.training else 0.0
            context = ttt_attention(query, kv_blocks, attention_mask,
                                    self.core_attention.softmax_scale, dropout)
        else:
            keys = torch.cat([k for k, _ in kv_blocks]).contiguous()
            values = torch.cat([v for _, v in kv_blocks]).contiguous()
            context = self.core_attention(
                query, keys, values, attention_mask, attn_mask_type=AttnMaskType.arbitrary
            )
        output, bias = self.linear_proj(context)
        return output if bias is None else output + bias


@dataclass
class Eagle3LayerSubmodules:
    input_layernorm: Union[ModuleSpec, type] = IdentityOp  # embedding norm (first layer) or input norm
    hidden_norm: Union[ModuleSpec, type] = IdentityOp  # first layer only
    self_attention: Union[ModuleSpec, type] = IdentityOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp


class Eagle3Layer(LayerOp, MegatronModule):
    """One draft decoder layer; `first` selects the two-stream (2h attention input) form."""

    def __init__(self, config, submodules: Eagle3LayerSubmodules, layer_number: int = 1,
                 first: bool = True):
        super().__init__(config=config)
        self.first = first
        norm_args = dict(config=config, hidden_size=config.hidden_size,
                         eps=config.layernorm_epsilon)
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_args)
        if first:
            self.hidden_norm = build_module(submodules.hidden_norm, **norm_args)
        self.self_attention = build_module(
            submodules.self_attention, config=config, layer_number=layer_number
        )
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_args)
        self.mlp = build_module(submodules.mlp, config=config)

    @cached_property
    def lean(self) -> bool:
        """Whether `decode` computes what forward does for this layer."""
        attention = self.self_attention
        return (isinstance(attention, DecodeSelfAttention) and attention.lean
                and lean_mlp(self.mlp))

    @cached_property
    def fused(self) -> tuple:
        """Which of (input norm, hidden norm, pre-MLP norm, activation) run as C++ ops."""
        return (fused_norm(self.input_layernorm),
                self.first and fused_norm(self.hidden_norm),
                fused_norm(self.pre_mlp_layernorm), fused_silu(self.mlp))

    @cached_property
    def layer_op(self) -> bool:
        """Whether a batch-1 chain can run the whole layer as the decode_layers op: every part
        one of its ops, the shared conditions (LayerOp.products_take_op), no bias."""
        input_norm, hidden_norm, mlp_norm, silu = self.fused
        return (input_norm and mlp_norm and silu and (hidden_norm or not self.first)
                and all(linear.bias is None for linear in self.linears)
                and self.products_take_op())

    @property
    def op_weights(self) -> tuple:
        """(weights, epsilons) the decode_layers op takes for this layer; each product's weight
        as weight_memory.streamed gives it (a draft trained in bf16 streams half the bytes)."""
        linears = self.linears
        qkv, proj, fc1, fc2 = (streamed(linear.weight) for linear in linears)
        dtype = linears[0].weight.dtype
        return ([self.input_layernorm.weight, qkv, None, proj,
                 self.pre_mlp_layernorm.weight, fc1, fc2,
                 self.hidden_norm.weight if self.first else None],
                [norm_eps(self.input_layernorm, dtype), norm_eps(self.pre_mlp_layernorm, dtype),
                 norm_eps(self.hidden_norm, dtype) if self.first else 0.0])

    def decode(self, hidden_states: Tensor, embeds: Optional[Tensor],
               attention_mask: Optional[Tensor], cache: DecodeCache) -> Tensor:
        """forward's output without grad for new positions over the drafter's `cache` (RoPE
        angles set on it), by the base's decoding ops in forward's order: as one
        decode_layers op where `whole` holds."""
        if self.whole(hidden_states, cache):
            return decode_chain([self], hidden_states, cache,
                                embeds=embeds.contiguous() if self.first else None)[0]
        input_norm, hidden_norm, mlp_norm, silu = self.fused
        if self.first:
            attn_input = torch.cat(
                [norm_decode(self.input_layernorm, embeds, input_norm),
                 norm_decode(self.hidden_norm, hidden_states, hidden_norm)], dim=-1
            )
        else:
            attn_input = norm_decode(self.input_layernorm, hidden_states, input_norm)
        out, bias = self.self_attention.decode(attn_input, attention_mask, cache)
        hidden_states = residual_add(out, bias, hidden_states)
        out, bias = mlp_decode(self.mlp, norm_decode(self.pre_mlp_layernorm, hidden_states,
                                                     mlp_norm), silu)
        return residual_add(out, bias, hidden_states)

    def forward(self, hidden_states: Tensor, embeds: Optional[Tensor],
                rotary_pos_emb: Optional[Tensor], attention_mask: Tensor,
                kv_blocks: KVBlocks) -> Tensor:
        if self.first:
            attn_input = torch.cat(
                [self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1
            )
        else:
            attn_input = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attention(
            attn_input, rotary_pos_emb, attention_mask, kv_blocks
        )
        mlp_out, mlp_bias = self.mlp(self.pre_mlp_layernorm(hidden_states))
        if mlp_bias is not None:
            mlp_out = mlp_out + mlp_bias
        return hidden_states + mlp_out

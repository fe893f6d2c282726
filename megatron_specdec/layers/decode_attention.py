"""Self-attention and core attention for decoding with a KV cache of rotated keys.

megatron-core's static-batching path caches keys before RoPE and rotates the whole cache
again in every layer of every step (cost growing with the context), and after the prefill
it switches the mask type to `no_mask`, which Transformer Engine obeys (a verified chain or
tree would then see later drafts). Under a `DecodeCache` this attention instead rotates only
the new keys, at explicit positions (per row, so ragged batches and tree nodes place tokens
where they belong), writes them into the preallocated cache and attends over it with the
mask the caller built, declared `arbitrary` so every backend applies it. Every other call
(training, megatron's own inference contexts) runs megatron's SelfAttention unchanged.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor


class DecodeCache(StaticInferenceContext):
    """Preallocated keys (after RoPE) and values per layer, [max_length, b, groups, head_dim];
    `sequence_len_offset` is the next slot to write. Before each forward the caller sets
    `rotary` to the RoPE frequencies of the new tokens, [s, b|1, 1, rotary_dim]."""

    def __init__(self, batch_size: int, max_length: int):
        super().__init__(batch_size, max_length)
        self.rotary: Optional[Tensor] = None

    def append(self, layer_number: int, key: Tensor, value: Tensor):
        """Write key/value [s, b, g, d] at the next slots; (keys, values) of every slot so far."""
        if layer_number not in self.key_value_memory_dict:
            shape = (self.max_sequence_length,) + tuple(key.shape[1:])
            self.key_value_memory_dict[layer_number] = (
                key.new_empty(shape), value.new_empty(shape))
        keys, values = self.key_value_memory_dict[layer_number]
        start, end = self.sequence_len_offset, self.sequence_len_offset + key.shape[0]
        if end > keys.shape[0]:
            raise ValueError(f"KV cache of {keys.shape[0]} slots cannot take {end}")
        keys[start:end] = key
        values[start:end] = value
        return keys[:end], values[:end]


class DecodeSelfAttention(SelfAttention):
    """SelfAttention with the DecodeCache path above; parameters and checkpoints unchanged."""

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, **kwargs):
        if not isinstance(inference_context, DecodeCache):
            return super().forward(hidden_states, attention_mask, key_value_states,
                                   inference_context, **kwargs)
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        freqs = inference_context.rotary
        if freqs is not None:
            query = apply_rotary_pos_emb(query, freqs, config=self.config)
            key = apply_rotary_pos_emb(key, freqs, config=self.config)
        keys, values = inference_context.append(self.layer_number, key, value)
        context = self.core_attention(query, keys, values, attention_mask,
                                      attn_mask_type=AttnMaskType.arbitrary)
        return self.linear_proj(context)


class SDPAttention(DotProductAttention):
    """megatron's local core attention with its inference forward on
    `torch.nn.functional.scaled_dot_product_attention` (grouped keys read in place, no
    [b, heads, s_q, s_k] buffers of megatron's own). Training keeps megatron's forward."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        plain = (attention_bias is None and packed_seq_params is None
                 and self.config.softmax_type == "vanilla"
                 and not self.config.apply_query_key_layer_scaling)
        if self.training or torch.is_grad_enabled() or not plain:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        s, b = query.shape[:2]
        causal = attention_mask is None and attn_mask_type == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=causal, scale=self.softmax_scale,
            enable_gqa=query.shape[2] != key.shape[2])
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

"""Self-attention and core attention for decoding with a KV cache of rotated keys.

megatron-core's static-batching path caches keys before RoPE and rotates the whole cache
again in every layer of every step (cost growing with the context), and after the prefill
it switches the mask type to `no_mask`, which Transformer Engine obeys (a verified chain or
tree would then see later drafts). Under a `DecodeCache` this attention instead rotates only
the new keys, at explicit per-row positions, writes them into each row's next slots of the
preallocated cache and attends over it with the mask the caller built, declared `arbitrary`
so every backend applies it. Every other call (training, megatron's own inference contexts)
runs megatron's SelfAttention unchanged.
"""

from functools import cached_property
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rope_utils import (
    _rotate_half,
    apply_rotary_pos_emb,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from torch import Tensor

from megatron_specdec.acceptance.ops import op_available
from megatron_specdec.models.layers.linear_kernels import INVARIANT_ROWS
from megatron_specdec.models.layers.small_rows_linear import decode_linear, plain_decoding_linear


# On a CPU, a batch-1 step or causal chain up to this long attends query by query on one
# thread (DecodeSelfAttention): the rows over which the decoding linears are row-invariant
# (models/layers/linear_kernels.py).
PER_QUERY_ROWS = INVARIANT_ROWS


def rope_cos_sin(freqs: Tensor, dtype) -> Tuple[Tensor, Tensor]:
    """cos and sin of RoPE angles `freqs` in `dtype` (as megatron's unfused RoPE computes
    them, so a rotation by them is bitwise its own)."""
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


class DecodeCache(StaticInferenceContext):
    """Preallocated keys (after RoPE) and values per layer, [max_length, b, groups, head_dim],
    with a length per row: rows of a batch accept different numbers of drafts, so each row
    appends at its own next slot and rolls back on its own.

    A forward of s tokens per row is `place`d first: row b's tokens go to slots
    lengths[b] .. lengths[b] + s - 1. With `counts` only the last counts[b] tokens of row b
    are real (a left-padded chunk: a ragged prompt, or ragged accepted tokens): they take the
    row's next counts[b] slots and the padding the slots after them, which stay beyond the
    row's length (never attended to, overwritten later). So a row's real tokens always sit at
    slots 0, 1, ..., whatever its padding, and RoPE position = slot by default."""

    def __init__(self, batch_size: int, max_length: int):
        super().__init__(batch_size, max_length)
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # host: real slots per row
        self.rotary: Optional[Tensor] = None  # [s, b|1, 1, rotary dim] of the new tokens
        self._cos_sin = None
        self._slots: Optional[Tensor] = None  # [s, b] where the new tokens go
        self._rows: Optional[Tensor] = None  # [s, b] their batch rows
        self._span = None  # (first, end): the slots when every row takes the same ones
        self._advance = None
        self._end = 0
        # Batch 1, causal, a few tokens (a chain verify): the cache end each query sees.
        self.query_ends: Optional[list] = None
        # What callers derive from the layers' buffers once (decode_layer.decode_chain's
        # operands), dropped when the buffers are replaced (keep_rows, swap_key_value_dict).
        self.memo = {}
        self._numbers = {}  # device -> arange(max_length): slot numbers to slice

    def place(self, s: int, device, counts: Optional[Tensor] = None) -> Tensor:
        """Slots [b, s] of the next forward (class notes); `commit` then advances each row by
        its real count."""
        self.query_ends = None
        if counts is None and self.lengths.numel() == 1:
            return self._place_one(s, device)
        j = torch.arange(s)
        if counts is None:
            slots = self.lengths[:, None] + j
            self._advance = s
        else:
            counts = counts.cpu()
            slots = self.lengths[:, None] + (j + counts[:, None] - s) % s
            self._advance = counts
        self._end = int(self.lengths.max()) + s
        self.check_room(self._end)
        self._slots = slots.T.to(device)
        first = int(self.lengths[0])
        # Every row appends at the same slots (batch 1, a decode step of equal rows): the
        # cache write is a slice copy, not an indexed scatter.
        self._span = (first, first + s) if counts is None and bool(
            (self.lengths == first).all()) else None
        self._rows = torch.arange(self.lengths.numel(), device=device).expand_as(self._slots)
        return slots.to(device)

    def check_room(self, end: int):
        """An error unless the cache has slots up to `end`."""
        if end > self.max_sequence_length:
            raise ValueError(f"KV cache of {self.max_sequence_length} slots cannot take {end}")

    def _place_one(self, s: int, device) -> Tensor:
        """`place` for one row of s tokens, from the cache's own slot numbers (a decode step's
        dozen small tensor ops cost ~0.15 ms a step on 2 cores)."""
        first = int(self.lengths[0])
        self._advance, self._end, self._span = s, first + s, (first, first + s)
        self.check_room(self._end)
        numbers = self._numbers.get(device)
        if numbers is None:
            numbers = self._numbers[device] = torch.arange(self.max_sequence_length,
                                                           device=device)
        slots = numbers[first: self._end][None]
        self._slots = slots.T
        self._rows = torch.zeros_like(self._slots)
        return slots

    def causal_mask(self, slots: Tensor) -> Optional[Tensor]:
        """[b, 1, s, end] True where a query at `slots` [b, s] may not attend (a later slot:
        a later token, or a slot beyond its row's length); None when nothing is masked (one
        token per row, all rows of one length). A batch-1 step or chain of up to PER_QUERY_ROWS
        tokens also sets `query_ends` (DecodeSelfAttention)."""
        b, s = slots.shape
        if b == 1 and s <= PER_QUERY_ROWS and slots.device.type == "cpu":
            self.query_ends = (slots[0] + 1).tolist()
        if s == 1 and (b == 1 or bool((self.lengths == self.lengths[0]).all())):
            return None
        keys = torch.arange(self._end, device=slots.device)
        return (keys[None, None, :] > slots[:, :, None])[:, None]

    def set_rotary(self, freqs: Optional[Tensor]):
        """RoPE angles [s, b|1, 1, rotary dim] of the next forward's tokens."""
        self.rotary, self._cos_sin = freqs, None

    def cos_sin(self, dtype) -> Tuple[Tensor, Tensor]:
        """cos and sin of `rotary`, computed once a forward rather than in every layer (as
        megatron's unfused RoPE computes them, so the rotation is bitwise its own)."""
        if self._cos_sin is None or self._cos_sin[0].dtype != dtype:
            self._cos_sin = rope_cos_sin(self.rotary, dtype)
        return self._cos_sin

    def chain_cos_sin(self, like: Tensor) -> Tuple[Tensor, Tensor]:
        """cos and sin [s, rotary dim] of a batch-1 chain of like.shape[0] tokens."""
        cos, sin = self.cos_sin(like.dtype)
        return cos.reshape(like.shape[0], -1), sin.reshape(like.shape[0], -1)

    def commit(self):
        """After the forward: every row's length grows by its real count."""
        self.lengths += self._advance

    def rewind(self, n):
        """Drop the last n (int, or per row [b]) real slots of each row."""
        self.lengths -= torch.as_tensor(n).cpu()

    def buffers(self, layer_number: int, slot_shape, like: Tensor) -> Tuple[Tensor, Tensor]:
        """The layer's whole (keys, values) [max_length, *slot_shape] (slot_shape: b, g, d),
        allocated at first use with `like`'s dtype and device."""
        if layer_number not in self.key_value_memory_dict:
            # Zeros, not empty: a row attends to none of the slots beyond its length, but a
            # masked NaN would still reach the output through its zero weight.
            shape = (self.max_sequence_length,) + tuple(slot_shape)
            self.key_value_memory_dict[layer_number] = (like.new_zeros(shape),
                                                        like.new_zeros(shape))
        return self.key_value_memory_dict[layer_number]

    def chain_start(self) -> Optional[int]:
        """The first slot of the placed tokens when they are one sequence's causal chain at
        consecutive slots on a CPU (what the chain_attention op computes), else None."""
        if self.query_ends is None or self._span is None:
            return None
        return self._span[0]

    def append(self, layer_number: int, key: Tensor, value: Tensor):
        """Write key/value [s, b, g, d] at the placed slots; (keys, values) of every slot up to
        the longest row's end."""
        keys, values = self.buffers(layer_number, key.shape[1:], key)
        if self._span is not None:
            keys[self._span[0]: self._span[1]] = key
            values[self._span[0]: self._span[1]] = value
        else:
            keys[self._slots, self._rows] = key
            values[self._slots, self._rows] = value
        return keys[: self._end], values[: self._end]

    def compact(self, start, slots: Tensor, counts: Optional[Tensor] = None):
        """Move each row's cached entries at slots[b, :counts[b]] (ascending, >= start[b]) to
        start[b], start[b] + 1, ... and drop every later one of the row (a verified draft
        tree's accepted path). start: int or [b]; slots [b, n] ([n]: batch 1); counts [b]
        (None: n)."""
        slots = slots.reshape(self.lengths.numel(), -1).cpu()
        n = slots.shape[1]
        start = torch.as_tensor(start).cpu().expand(self.lengths.numel())
        counts = torch.full_like(start, n) if counts is None else torch.as_tensor(counts).cpu()
        dest = start[:, None] + torch.arange(n)
        real = torch.arange(n) < counts[:, None]
        src = torch.where(real, slots, dest)  # padding moves onto itself
        rows = torch.arange(slots.shape[0])[:, None].expand_as(slots)
        for key, value in self.key_value_memory_dict.values():
            # Advanced indexing reads every source before writing: no overlap hazard.
            key[dest, rows] = key[src, rows]
            value[dest, rows] = value[src, rows]
        self.lengths[:] = start + counts

    def keep_rows(self, rows: Tensor):
        """Keep only the batch rows `rows` (ascending indices), in that order (rows that
        finished leave the batch)."""
        rows = rows.cpu()
        self.memo = {}
        self.key_value_memory_dict = {
            layer: (key[:, rows.to(key.device)], value[:, rows.to(key.device)])
            for layer, (key, value) in self.key_value_memory_dict.items()}
        self.lengths = self.lengths[rows].clone()
        self.max_batch_size = rows.numel()

    def swap_key_value_dict(self, batch_idx):
        """megatron's batch reorder: new buffers, so what was derived from the old goes."""
        self.memo = {}
        super().swap_key_value_dict(batch_idx)

    def row(self, b: int) -> "DecodeCache":
        """A batch-1 view of row b: what is written through it is row b's (a drafter growing
        one row's tree)."""
        view = DecodeCache(1, self.max_sequence_length)
        view.key_value_memory_dict = {layer: (key[:, b: b + 1], value[:, b: b + 1])
                                      for layer, (key, value) in
                                      self.key_value_memory_dict.items()}
        view.lengths = self.lengths[b: b + 1]
        return view

    def blocks(self, layer_number: int):
        """This layer's cache as the block list an EAGLE3 draft layer appends to
        (methods/eagle3/draft_layer.py): appending writes at the placed slots, and the list then
        holds one block, every slot so far."""
        return _CacheBlocks(self, layer_number)


class _CacheBlocks(list):
    def __init__(self, cache: DecodeCache, layer_number: int):
        super().__init__()
        self.cache, self.layer_number = cache, layer_number

    def append(self, key_value):
        self[:] = [self.cache.append(self.layer_number, *key_value)]


class DecodeSelfAttention(SelfAttention):
    """SelfAttention with the DecodeCache path above; parameters and checkpoints unchanged.
    `decode` is the same path without the linears' and the QKV split's per-call machinery,
    for the decoding layer (models/layers/decode_layer.py)."""

    def forward(self, hidden_states, attention_mask=None, key_value_states=None,
                inference_context=None, **kwargs):
        if not isinstance(inference_context, DecodeCache):
            return super().forward(hidden_states, attention_mask, key_value_states,
                                   inference_context, **kwargs)
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        return self.linear_proj(self._attend(query, key, value, attention_mask,
                                             inference_context))

    @cached_property
    def lean(self) -> bool:
        """Whether `decode` computes what forward does: small-row linears, at least one query
        group per TP rank (megatron gathers the QKV output otherwise), no output gate."""
        return (plain_decoding_linear(self.linear_qkv) and plain_decoding_linear(self.linear_proj)
                and self.config.num_query_groups >= self.world_size
                and not getattr(self.config, "attention_output_gate", False)
                and not self.config.test_mode)

    @cached_property
    def chain_op(self) -> bool:
        """Whether a batch-1 chain's RoPE, cache write and attention can run as the C++
        chain_attention op: float32, rotate-half RoPE, no q/k norm, plain softmax."""
        config = self.config
        return (config.params_dtype == torch.float32
                and all(norm is None or isinstance(norm, IdentityOp)
                        for norm in (self.q_layernorm, self.k_layernorm))
                and not config.rotary_interleaved
                and not config.apply_rope_fusion and not config.multi_latent_attention
                and isinstance(self.core_attention, SDPAttention)
                and config.softmax_type == "vanilla"
                and not config.apply_query_key_layer_scaling
                and op_available("chain_attention"))

    def decode(self, hidden_states, attention_mask, cache: DecodeCache):
        """(output, bias) of forward under `cache`, by the same tensor ops: megatron's QKV
        split (get_query_key_value_tensors) written out; a batch-1 chain on a CPU (chain_op)
        by one C++ op from the QKV product to the attention output."""
        mixed, _ = decode_linear(self.linear_qkv, hidden_states)
        first = cache.chain_start()
        if (first is not None and self.chain_op and cache.rotary is not None
                and mixed.dtype == torch.float32):
            return decode_linear(self.linear_proj, self._chain(mixed, cache, first))
        groups = self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        dim = self.hidden_size_per_attention_head
        mixed = mixed.view(*mixed.shape[:-1], groups, (per_group + 2) * dim)
        query, key, value = torch.split(mixed, [per_group * dim, dim, dim], dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, dim)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return decode_linear(self.linear_proj,
                             self._attend(query, key, value, attention_mask, cache))

    def _chain(self, mixed, cache: DecodeCache, first: int) -> Tensor:
        """Attention output [s, 1, heads * d] of a batch-1 chain from its QKV product."""
        return torch.ops.megatron_specdec.chain_attention(mixed, *self.chain_args(cache, first,
                                                                                mixed))

    def chain_args(self, cache: DecodeCache, first: int, like: Tensor) -> tuple:
        """(cos, sin, keys, values, first, heads, scale): chain_attention's arguments after the
        QKV product, for a chain of like.shape[0] tokens."""
        keys, values, heads, scale = self.chain_cache(cache, like)
        return (*cache.chain_cos_sin(like), keys, values, first, heads, scale)

    def chain_cache(self, cache: DecodeCache, like: Tensor) -> tuple:
        """(keys, values, heads, scale): what chain_attention reads of this layer and its
        cache, the same at every step of the cache."""
        dim = self.hidden_size_per_attention_head
        keys, values = cache.buffers(
            self.layer_number, (1, self.num_query_groups_per_partition, dim), like)
        scale = self.core_attention.softmax_scale
        return (keys, values, self.num_attention_heads_per_partition,
                dim ** -0.5 if scale is None else scale)

    def _attend(self, query, key, value, attention_mask, cache: DecodeCache) -> Tensor:
        """Rotate the new queries and keys, append keys and values to the cache, attend."""
        freqs = cache.rotary
        if freqs is not None and (self.config.apply_rope_fusion
                                  or self.config.multi_latent_attention):
            query = apply_rotary_pos_emb(query, freqs, config=self.config)
            key = apply_rotary_pos_emb(key, freqs, config=self.config)
        elif freqs is not None:
            cos, sin = cache.cos_sin(query.dtype)
            query = rotate(query, cos, sin, self.config.rotary_interleaved)
            key = rotate(key, cos, sin, self.config.rotary_interleaved)
        keys, values = cache.append(self.layer_number, key, value)
        ends = cache.query_ends
        if ends is None:
            return self.core_attention(query, keys, values, attention_mask,
                                       attn_mask_type=AttnMaskType.arbitrary)
        # Each query of a batch-1 chain as the one-token step at its position runs it (the
        # same call): the kernel's result for a query depends on how many share the call, so
        # this keeps a verify forward's attention bitwise equal to plain steps'.
        return torch.cat(per_query(
            lambda i, end: self.core_attention(query[i: i + 1], keys[:end], values[:end],
                                               None, attn_mask_type=AttnMaskType.arbitrary),
            ends))


class SDPAttention(DotProductAttention):
    """megatron's local core attention with its inference forward on
    `torch.nn.functional.scaled_dot_product_attention` (grouped keys read in place, once per
    group, no [b, heads, s_q, s_k] buffers of megatron's own). Training keeps megatron's
    forward."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        plain = (attention_bias is None and packed_seq_params is None
                 and self.config.softmax_type == "vanilla"
                 and not self.config.apply_query_key_layer_scaling)
        if self.training or torch.is_grad_enabled() or not plain:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        causal = attention_mask is None and attn_mask_type == AttnMaskType.causal
        mask = None if attention_mask is None else ~attention_mask
        # CUDA's fused kernels take enable_gqa only in half precision without a mask; else
        # SDPA falls back to its math path, which copies the whole cache `rep` times in every
        # layer. On a CPU its flash kernel reads grouped keys in place and is the faster one.
        fold = query.is_cuda and (mask is not None or query.dtype == torch.float32)
        out = grouped_sdpa(query, key, value, mask, causal, self.softmax_scale, fold)
        return out.reshape(out.shape[0], out.shape[1], self.hidden_size_per_partition)


def per_query(attend, ends) -> list:
    """attend(i, end) for each query of a chain, on one thread: each call is a few heads over
    one query (a result that does not depend on the thread count), too small to be worth a
    parallel region, and a region per call costs more than the call on a busy machine."""
    threads = torch.get_num_threads()
    if threads > 1 and not torch.is_grad_enabled() and not torch.cuda.is_available():
        torch.set_num_threads(1)
    try:
        return [attend(i, end) for i, end in enumerate(ends)]
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def rotate(t: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """megatron's unfused RoPE (rope_utils._apply_rotary_pos_emb_bshd, mscale 1) with cos and
    sin given: t [s, b, heads, d] rotated over its first cos.shape[-1] channels."""
    dim = cos.shape[-1]
    rotated = t[..., :dim] * cos + _rotate_half(t[..., :dim], interleaved) * sin
    return rotated if dim == t.shape[-1] else torch.cat((rotated, t[..., dim:]), dim=-1)


def grouped_sdpa(query, key, value, mask, causal: bool, scale: float, fold: bool) -> Tensor:
    """Attention of query [s, b, heads, d] over key/value [s_k, b, groups, d] (mask [b|1, 1,
    s, s_k], True = may attend), as [s, b, heads, d]. `fold`: the heads of a query group
    become rows of one query over that group's keys, so every backend reads each key once
    (not with `causal`)."""
    s, b, heads, d = query.shape
    groups = key.shape[2]
    rep = heads // groups
    query = query.permute(1, 2, 0, 3)  # [b, heads, s, d]
    fold = fold and rep > 1 and not causal
    if fold:
        query = query.reshape(b, groups, rep * s, d)
        mask = None if mask is None else mask.expand(-1, -1, s, -1).repeat(1, 1, rep, 1)
    out = F.scaled_dot_product_attention(
        query, key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), attn_mask=mask,
        is_causal=causal, scale=scale, enable_gqa=rep > 1 and not fold)
    return out.reshape(b, heads, s, d).permute(2, 0, 1, 3)

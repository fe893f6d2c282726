"""The EAGLE3 draft module: fc over the captured base states, draft layers, norm, lm_head.

Lives on the last pipeline stage. `fc` (n_aux*h -> h, no bias) is replicated across TP;
attention and MLP are megatron-core Column/RowParallel layers; `lm_head` is ColumnParallel
over the draft vocabulary, padded to a multiple of 128 (independent of TP, so checkpoints
reshard) with padded logits masked to -inf. `d2t`/`t2d` are persistent buffers, so they
travel in `sharded_state_dict` (replicated). A parallel-drafting (P-EAGLE) draft adds
`mask_hidden` (the learned aux state of its mask positions, replicated) and `mask_embed` (the
base's embedding of the mask token, a buffer set when the draft is attached, since the last
pipeline stage holds no embedding table).
"""

from dataclasses import dataclass, field
from functools import cached_property
from typing import List, Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from megatron.core import parallel_state as ps
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_specdec.models.layers.decode_attention import DecodeCache
from megatron_specdec.models.layers.decode_layer import fused_norm, norm_decode
from megatron_specdec.models.layers.sharded import ShardedModuleList
from megatron_specdec.models.layers.small_rows_linear import (
    SmallRowsColumnParallelLinear,
    decode_linear,
    plain_decoding_linear,
    rows_linear,
)
from megatron_specdec.methods.eagle3.ttt_attention import TTTMask


@dataclass
class Eagle3ModuleSubmodules:
    layers: List[ModuleSpec] = field(default_factory=list)
    final_layernorm: object = IdentityOp


def shift_right(hidden: Tensor) -> Tensor:
    """Position u takes position u-1's state (position 0 gets zeros: it is never scored)."""
    return torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])


class Eagle3Module(MegatronModule):
    def __init__(self, config, submodules: Eagle3ModuleSubmodules, num_aux: int,
                 draft_vocab_size: int, padded_draft_vocab_size: int, vocab_size: int,
                 parallel_drafting: bool = False):
        super().__init__(config=config)
        h = config.hidden_size
        self.draft_vocab_size = draft_vocab_size
        self.fc = torch.nn.Linear(num_aux * h, h, bias=False, dtype=config.params_dtype)
        config.init_method(self.fc.weight.data)
        self.parallel_drafting = parallel_drafting
        if parallel_drafting:
            self.mask_hidden = torch.nn.Parameter(
                torch.empty(1, num_aux * h, dtype=config.params_dtype))
            config.init_method(self.mask_hidden.data)
            self.register_buffer("mask_embed", torch.zeros(h, dtype=config.params_dtype))
        self.layers = ShardedModuleList(
            build_module(spec, config=config, layer_number=i + 1)
            for i, spec in enumerate(submodules.layers)
        )
        self.final_layernorm = build_module(
            submodules.final_layernorm, config=config, hidden_size=h, eps=config.layernorm_epsilon
        )
        self.lm_head = SmallRowsColumnParallelLinear(
            h, padded_draft_vocab_size, config=config, init_method=config.init_method,
            bias=False, gather_output=False,
        )
        # Identity draft vocabulary until calibrated: draft id d is target id d.
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        per_rank = padded_draft_vocab_size // tp
        self.vocab_offset = rank * per_rank
        self.register_buffer(
            "_padded_ids",
            torch.arange(self.vocab_offset, self.vocab_offset + per_rank) >= draft_vocab_size,
            persistent=False,
        )
        self._pads = bool(self._padded_ids.any())  # TP ranks without padded columns skip masking
        # Megatron's switch for recomputing whole layers, set on the draft's config by the
        # recipe key training.recompute (speculative.build_draft): in training-time test each
        # draft layer then keeps only its inputs and this step's keys/values per unrolled step.
        self.recompute = config.recompute_granularity == "full"

    def target_ids(self) -> Tensor:
        """Target id of every draft id, int64 [draft_vocab_size]."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, d2t: Tensor, t2d: Tensor):
        target = torch.arange(d2t.numel()) + d2t.cpu()
        if d2t.numel() != self.d2t.numel() or t2d.numel() != self.t2d.numel():
            raise ValueError(
                f"draft vocabulary of {d2t.numel()} over {t2d.numel()} ids does not fit a draft "
                f"module of {self.d2t.numel()} over {self.t2d.numel()}"
            )
        if not torch.equal(t2d.cpu().nonzero().flatten(), target):
            raise ValueError("d2t and t2d disagree (t2d must mark exactly draft_id + d2t[draft_id])")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_output_from_base(self, base_lm_head_shard: Tensor, base_final_norm: Tensor):
        """lm_head rows := the base's output rows of each draft id's target id (padded rows
        zero), final norm := the base's. `base_lm_head_shard` is this TP rank's vocab-parallel
        slice; the full table is gathered so every TP layout gets the same draft."""
        group = ps.get_tensor_model_parallel_group()
        shards = [torch.empty_like(base_lm_head_shard)
                  for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(shards, base_lm_head_shard.contiguous(), group=group)
        rows = torch.cat(shards)[self.target_ids().to(base_lm_head_shard.device)]
        weight = self.lm_head.weight
        padded = torch.zeros(weight.shape[0] * ps.get_tensor_model_parallel_world_size(),
                             rows.shape[1], dtype=weight.dtype, device=weight.device)
        padded[: rows.shape[0]] = rows
        weight.copy_(padded[self.vocab_offset: self.vocab_offset + weight.shape[0]])
        if hasattr(self.final_layernorm, "weight"):
            self.final_layernorm.weight.copy_(base_final_norm)

    def project(self, aux: Tensor) -> Tensor:
        """Captured base states [s, b, n_aux*h] -> the draft's hidden input [s, b, h] (a few
        rows by the product this machine runs fastest)."""
        return rows_linear(aux, self.fc.weight)

    def mask_input(self, s: int, b: int):
        """(embeds, hidden) [s, b, h] of s mask positions of a parallel-drafting draft."""
        h = self.mask_embed.shape[0]
        return (self.mask_embed.expand(s, b, h),
                self.project(self.mask_hidden).expand(s, b, h))

    def step(self, embeds: Tensor, hidden: Tensor, rotary_pos_emb: Optional[Tensor],
             attention_mask: Tensor, kv_blocks: List[list], last: int = 0):
        """One draft step. embeds: embedding of the token after each position [s, b, h];
        hidden: the draft's hidden input [s, b, h]; kv_blocks: one list per draft layer
        (this step's keys/values are appended). Returns (hidden_out [s, b, h], logits over
        this TP rank's slice of the padded draft vocabulary [s, b, Dp/TP], padded = -inf);
        with `last` > 0 the logits of the last `last` positions only (drafting reads no
        others)."""
        hidden = self._layers(embeds, hidden, rotary_pos_emb, attention_mask, kv_blocks)
        return hidden, self.head(hidden[-last:] if last else hidden)

    @cached_property
    def lean(self) -> bool:
        """Whether `decode_step` computes what `step` does: every layer's decoding path and a
        plain small-rows lm_head."""
        return all(layer.lean for layer in self.layers) and plain_decoding_linear(self.lm_head)

    def decode_step(self, embeds: Tensor, hidden: Tensor, attention_mask: Optional[Tensor],
                    cache: DecodeCache, last: int = 0):
        """`step` without grad over the drafter's `cache`, whose keys and values it appends
        and whose RoPE angles (DecodeCache.set_rotary) it reads, without megatron's per-call
        machinery (Eagle3Layer.decode)."""
        for layer in self.layers:
            hidden = layer.decode(hidden, embeds, attention_mask, cache)
        out = hidden[-last:] if last else hidden
        logits, _ = decode_linear(self.lm_head, norm_decode(
            self.final_layernorm, out, fused_norm(self.final_layernorm)))
        return hidden, self._unpadded(logits)

    def _layers(self, embeds, hidden, rotary_pos_emb, attention_mask, kv_blocks) -> Tensor:
        recompute = self.recompute and torch.is_grad_enabled()
        for layer, blocks in zip(self.layers, kv_blocks):
            if recompute:
                hidden = self._recomputed_layer(layer, embeds, hidden, rotary_pos_emb,
                                                attention_mask, blocks)
            else:
                hidden = layer(hidden, embeds, rotary_pos_emb, attention_mask, blocks)
        return hidden

    @staticmethod
    def _recomputed_layer(layer, embeds, hidden, rotary_pos_emb, attention_mask, blocks):
        """`layer` under activation recomputation. torch's non-reentrant checkpoint, not
        megatron's reentrant one: this step's keys/values leave the region (later steps
        attend to them) and the TTT attention's dropout draws from torch's RNG, which it
        restores for the recompute. The region is pure: earlier blocks come in as inputs and
        the new block goes out as outputs, so recomputing appends nothing."""
        def run(hidden, embeds, *flat):
            own = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
            out = layer(hidden, embeds, rotary_pos_emb, attention_mask, own)
            return (out, *own[-1])

        flat = [t for block in blocks for t in block]
        hidden, key, value = checkpoint(run, hidden, embeds, *flat, use_reentrant=False)
        blocks.append((key, value))
        return hidden

    def head(self, hidden: Tensor) -> Tensor:
        """Final norm and lm_head: [..., h] -> this rank's draft logits (padded = -inf)."""
        logits, _ = self.lm_head(self.final_layernorm(hidden))
        return self._unpadded(logits)

    def _unpadded(self, logits: Tensor) -> Tensor:
        """The padded draft-vocabulary columns of this rank's logits set to -inf."""
        return logits.masked_fill(self._padded_ids, float("-inf")) if self._pads else logits

    def ttt_hidden(self, aux: Tensor, embeds: Tensor, rotary_pos_emb: Optional[Tensor],
                   base_mask: Optional[Tensor], ttt_steps: int,
                   rows: Optional[Tensor] = None) -> List[Tensor]:
        """The last draft layer's output of every unrolled step, [s, b, h]; step k is fed step
        k-1's output shifted by one position and attends as `TTTMask` says. With `rows`
        (indices into the [s*b] positions, s-major) those positions only, [n, 1, h]: the
        loss reads no others.

        A parallel-drafting draft feeds every step k >= 1 its mask input instead: step k at
        position u is then the mask position k of the block whose real position is u-k, and
        TTTMask's keys (the real prefix to u-k, the block's positions 1..k) are exactly what
        that mask position attends to when the block is drafted in one forward."""
        hidden = self.project(aux)
        s, b, h = hidden.shape
        kv_blocks = [[] for _ in self.layers]
        outs = []
        for k in range(ttt_steps):
            if k and self.parallel_drafting:
                embeds, hidden = self.mask_input(s, b)
            elif k:
                hidden = shift_right(hidden)
            hidden = self._layers(embeds, hidden, rotary_pos_emb, TTTMask(base_mask, k),
                                  kv_blocks)
            outs.append(hidden if rows is None
                        else hidden.reshape(s * b, 1, h).index_select(0, rows))
        return outs

    def training_time_test(self, aux: Tensor, embeds: Tensor, rotary_pos_emb: Optional[Tensor],
                           base_mask: Optional[Tensor], ttt_steps: int) -> List[Tensor]:
        """Draft logits [s, b, Dp/TP] of every unrolled step (`ttt_hidden` through `head`)."""
        return [self.head(h) for h in self.ttt_hidden(aux, embeds, rotary_pos_emb, base_mask,
                                                       ttt_steps)]

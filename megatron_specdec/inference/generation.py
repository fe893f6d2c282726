"""Batched greedy (or sampled) generation from a Megatron GPTModel with a static KV cache, at any TP/PP.

Every rank of the model-parallel group runs the same loop. Pipeline stages hand hidden states
to the next stage with point-to-point sends; the last stage gathers the vocab-parallel logits
and broadcasts the chosen tokens back to all stages. Prompts are left-padded, and each row of
the cache has its own length (layers.decode_attention.DecodeCache): a row's tokens sit at the
slots and RoPE positions they would have alone, whatever the batch.
"""

import os
from typing import Optional

import torch
import torch.distributed as dist

from megatron_specdec.models.layers.decode_attention import rope_cos_sin
from megatron_specdec.models.layers.decode_embedding import decode_embedding, lookup
from megatron_specdec.models.layers.decode_layer import norm_eps

# SPECDEC_GREEDY_CHAIN=0: every forward takes StageRunner's general step (benchmarks).
GREEDY_CHAIN_ENV = "SPECDEC_GREEDY_CHAIN"
# Greedy plain_generate drops finished rows once they are 1/_DROP_SHARE of the batch.
_DROP_SHARE = 4

# Prompt batches are left-padded to a multiple of this many tokens (left_pad).
PROMPT_BUCKET = 16


class StageRunner:
    """One forward of this pipeline stage over a preallocated KV cache: `step(tokens)` appends
    `tokens` [b, s] to the cache and returns full-vocabulary logits [b, s, V] on the last
    stage (None elsewhere). `rewind(n)` drops the last n cached positions (per row); `compact`
    keeps chosen ones (a verified draft tree's accepted path).

    The stage runs as explicit code (embedding, each decoder layer, final norm, output
    layer) rather than through GPTModel.forward, so that a speculative decoder can read the
    residual stream after chosen layers (`capture_ids`, 0-based output-of-layer) and the
    final normed hidden state (`capture_final`) from `captured` after each step. The cache
    is a layers.decode_attention.DecodeCache: keys are stored rotated at the RoPE position
    each token was given, and only the new tokens are rotated per step."""

    def __init__(self, model, batch_size: int, max_length: int, vocab_size: int,
                 capture_ids=(), capture_final: bool = False):
        from megatron_specdec.models.layers.decode_attention import DecodeCache
        from megatron_specdec.models.layers.decode_layer import fused_norm
        from megatron_specdec.models.weight_memory import place_weights

        place_weights(model)
        self.model = model
        self.vocab_size = vocab_size
        self.context = DecodeCache(batch_size, max_length)
        self.rotary = model.rotary_pos_emb(max_length)  # [max_length, 1, 1, rotary dim]
        # The model's own groups, not the global ones: a draft model runs in its own layout
        # (methods/draft_model/proposer.py) beside the target's.
        self.first, self.last = model.pre_process, model.post_process
        self.pp_group = model.pg_collection.pp
        stages = dist.get_process_group_ranks(self.pp_group)
        here = stages.index(dist.get_rank())
        self.prev_rank = stages[here - 1]
        self.next_rank = stages[(here + 1) % len(stages)]
        self.last_rank = stages[-1]
        self.hidden_size = model.config.hidden_size
        self.dtype = model.config.params_dtype
        self.capture_ids = set(capture_ids)
        # Indices into the stage's layers of those whose outputs are captured.
        self.capture_at = [i for i, layer in enumerate(model.decoder.layers)
                           if layer.layer_number - 1 in self.capture_ids]
        self.capture_final = capture_final
        self.captured = {}
        # Decided once, not per step: whether the final norm runs as the C++ op.
        self.final_norm_fused = self.last and fused_norm(model.decoder.final_layernorm)
        self._chained = False  # the last forward's layers ran as one decode_layers op
        # Whether greedy chains may run as GreedyChain: the whole model on one TP rank with the
        # final norm op; off with SPECDEC_GREEDY_CHAIN=0 (a bench's reference).
        self.fast_steps = (self.first and self.final_norm_fused
                           and model.tp_group.size() == 1
                           and os.environ.get(GREEDY_CHAIN_ENV, "1") != "0")

    @property
    def lengths(self) -> torch.Tensor:
        """[b] cached tokens per row (host)."""
        return self.context.lengths

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, last_only: bool = False, positions=None,
             attention_mask=None, counts=None, greedy: bool = False):
        """Logits [b, s, vocab] of `tokens` on the last stage (None elsewhere); with
        `last_only` just the final position's, so a long prefill never holds [b, s, vocab].
        With `greedy` the argmax ids [b, s] instead (int64; `_greedy`).

        Row b's tokens go to its next slots and, by default, take RoPE position = slot and
        attend causally. `counts` [b]: only the last counts[b] tokens of row b are real (a
        left-padded chunk, layers.decode_attention.DecodeCache), so the final position holds
        every row's newest real token. Draft trees pass their own `positions` [b, s] and
        `attention_mask` [b, 1, s, max length + s] (True = may not attend; tree.verify_layout).
        A batch-1 greedy chain (a plain step, a verify) runs as GreedyChain once one of its
        width has run here (unless `fast_steps` is off)."""
        b, s = tokens.shape
        chain = (greedy and b == 1 and counts is None and positions is None
                 and attention_mask is None and (s == 1 or not last_only) and self.fast_steps)
        fast = self.context.memo.get(_GREEDY_CHAIN) if chain else None
        if fast is not None and s in fast.widths:
            return fast(self, tokens)
        device = tokens.device
        slots = self.context.place(s, device, counts)
        pos = slots if positions is None else positions.expand(b, s)
        if self.first:
            hidden = decode_embedding(self.model.embedding, tokens, pos)
        else:
            hidden = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=device)
            dist.recv(hidden, src=self.prev_rank)
        mask = self.context.causal_mask(slots) if attention_mask is None else attention_mask
        self.context.set_rotary(self.rotary[pos.T][:, :, 0])
        hidden = self._layers(hidden, mask)
        self.context.commit()
        if not self.last:
            dist.send(hidden.contiguous(), dst=self.next_rank)
            return None
        hidden = self._final_norm(hidden[-1:] if last_only else hidden)
        ids = self._greedy(hidden) if greedy else self._logits(hidden)
        if chain and self._chained:
            self._plan_chain(s)
        return ids

    def _plan_chain(self, s: int):
        """After a greedy batch-1 chain of s tokens that ran the layers as one op (on a runner
        whose `fast_steps` holds): where the rest of such a forward is a plain lookup and the
        screened head, the next ones of its width run as GreedyChain (kept in the cache's
        memo, so dropped with it)."""
        from megatron_specdec.models.layers.decode_embedding import plain_lookup
        from megatron_specdec.models.layers.greedy_head import greedy_head

        weight = self._output_weight()
        head = greedy_head(weight, min(weight.shape[0], self.vocab_size), s)
        if head is None or not plain_lookup(self.model.embedding):
            return
        fast = self.context.memo.get(_GREEDY_CHAIN)
        if fast is None:
            fast = self.context.memo[_GREEDY_CHAIN] = GreedyChain(self, head)
        fast.add_width(self, s)

    def _layers(self, hidden, mask):
        """This stage's decoder layers over the cache, recording the outputs named in
        `capture_ids`. A decoding layer no hook watches runs its decode path directly; where
        every layer runs it as the whole-layer op, they run as one op (decode_chain)."""
        from megatron_specdec.models.layers.decode_layer import (
            DecodeTransformerLayer,
            decode_chain,
        )

        self.captured = {}
        self._chained = False
        layers = self.model.decoder.layers
        if all(isinstance(layer, DecodeTransformerLayer) and layer.direct_decode(self.context)
               and layer.whole(hidden, self.context) for layer in layers):
            *outputs, hidden = decode_chain(list(layers), hidden, self.context, self.capture_at)
            self.captured = {layers[i].layer_number - 1: out
                             for i, out in zip(self.capture_at, outputs)}
            self._chained = True
            return hidden
        for layer in layers:
            if isinstance(layer, DecodeTransformerLayer) and layer.direct_decode(self.context):
                hidden = layer.decode(hidden, mask, self.context)
            else:
                hidden, _ = layer(hidden_states=hidden, attention_mask=mask,
                                  inference_context=self.context)
            if layer.layer_number - 1 in self.capture_ids:
                self.captured[layer.layer_number - 1] = hidden
        return hidden

    def _final_norm(self, hidden):
        """The final norm (its output captured for Medusa)."""
        from megatron_specdec.models.layers.decode_layer import norm_decode

        hidden = norm_decode(self.model.decoder.final_layernorm, hidden, self.final_norm_fused)
        if self.capture_final:
            self.captured["final"] = hidden
        return hidden

    def _output_weight(self):
        model = self.model
        return (model.shared_embedding_or_output_weight()
                if model.share_embeddings_and_output_weights else model.output_layer.weight)

    def _logits(self, hidden):
        """The output layer over normed `hidden` [s, b, h]; the vocab-parallel logits are
        gathered over TP."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        from megatron_specdec.models.layers.small_rows_linear import rows_linear

        logits = rows_linear(hidden, self._output_weight())
        if self.model.tp_group.size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits, group=self.model.tp_group)
        return logits.transpose(0, 1)[..., : self.vocab_size].float()

    def _greedy(self, hidden):
        """Argmax ids [b, s] of the logits over normed `hidden` [s, b, h], bitwise those of
        `_logits` (ties: the lowest id): through the screened greedy head where it runs
        (models/layers/greedy_head.py: a quarter of the output layer's bytes), else the logits."""
        from megatron_specdec.models.layers.greedy_head import output_argmax

        s, b, h = hidden.shape
        ids = output_argmax(hidden.transpose(0, 1).reshape(b * s, h), self._output_weight(),
                            self.vocab_size, self.model.tp_group)
        if ids is None:
            return self._logits(hidden).argmax(-1)
        return ids.view(b, s)

    def rewind(self, n):
        """Drop the last n (int, or per row [b]) cached tokens of each row."""
        self.context.rewind(n)

    def compact(self, start, slots: torch.Tensor, counts=None):
        """Keep each row's cached entries at slots[b, :counts[b]] (ascending, >= start[b]) as
        start[b], start[b] + 1, ... and drop every later one (DecodeCache.compact). Keys are
        cached rotated at their RoPE position, so when each moved entry's position equals its
        new slot (a tree's accepted path: prefix + depth) the result is the cache a chain
        forward over the same tokens writes; nothing is recomputed."""
        self.context.compact(start, slots, counts)

    def keep_rows(self, rows: torch.Tensor):
        """Drop every batch row not in `rows` (ascending) from the cache."""
        self.context.keep_rows(rows)

    def broadcast_from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Give every stage the last stage's `tensor` (same shape and dtype on all ranks)."""
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(tensor, src=self.last_rank, group=self.pp_group)
        return tensor


_GREEDY_CHAIN = "greedy chain"


class GreedyChain:
    """A greedy forward of a batch-1 runner that is the whole model (first and last stage,
    one TP rank) over a chain of s tokens (a plain step, a verify of s - 1 drafts) whose
    layers run as one decode_layers op: the lookup, the op over operands taken once per
    width (decode_layer.FrozenChainStep), the final norm op and the screened head, with none
    of the general step's per-forward work between them (slot placement, masks, the layers'
    checks, the weights' lookups, the head's). The same ops on the same values as
    StageRunner.step, so the same ids and captured states, bitwise
    (tests/test_generation_fast_step.py). That work cost more than its own time: each
    forward's first code and data come back from memory after the layers' stream
    (RESULTS.md, "The greedy chain without the general step")."""

    def __init__(self, runner: StageRunner, head):
        model = runner.model
        self.layers = list(model.decoder.layers)
        self.capture = runner.capture_at
        self.captured_as = [self.layers[i].layer_number - 1 for i in self.capture]
        # Nothing here refers back to the runner or its cache, whose memo holds this.
        self.widths = {}  # s -> FrozenChainStep
        self.head = head
        self.embedding = model.embedding.word_embeddings.weight
        norm = model.decoder.final_layernorm
        self.norm_weight, self.norm_eps = norm.weight, norm_eps(norm, runner.dtype)

    def add_width(self, runner: StageRunner, s: int):
        """Chains of s tokens too (after one ran through the general step: its operands)."""
        from megatron_specdec.models.layers.decode_layer import FrozenChainStep

        if s not in self.widths:
            self.widths[s] = FrozenChainStep(self.layers, runner.context, self.capture, s)

    def __call__(self, runner: StageRunner, tokens: torch.Tensor) -> torch.Tensor:
        """Argmax ids [1, s] of tokens [1, s], appended to `runner`'s cache."""
        cache = runner.context
        s = tokens.shape[1]
        start = int(cache.lengths[0])
        cache.check_room(start + s)
        hidden = lookup(self.embedding, tokens)
        cos, sin = rope_cos_sin(runner.rotary[start: start + s], runner.dtype)
        *outputs, hidden = self.widths[s](hidden, cos.reshape(s, -1), sin.reshape(s, -1), start)
        cache.lengths += s
        runner.captured = dict(zip(self.captured_as, outputs))
        hidden = torch.ops.megatron_specdec.rms_norm(hidden, self.norm_weight, self.norm_eps)
        if runner.capture_final:
            runner.captured["final"] = hidden
        return self.head(hidden.reshape(s, -1))[0].view(1, s)


def left_pad(prompts, pad_id: int, device=None, bucket: Optional[int] = None):
    """[b, L] tokens and [b] lengths of a ragged batch of prompts (the chunk
    StageRunner.step takes with `counts`), L the longest prompt rounded up to a multiple of
    `bucket` (None: PROMPT_BUCKET). In bf16 oneDNN keeps a kernel per GEMM shape: a prefill
    of a new length per prompt grew a long generation's memory without bound
    (bench/bench_soak.py --generate); the padding is masked like a shorter row's."""
    if not prompts:
        raise ValueError("prompts: need a batch of at least one prompt")
    bucket = PROMPT_BUCKET if bucket is None else bucket
    if bucket < 1:
        raise ValueError(f"prompt_bucket: expected a positive integer, got {bucket}")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts: every prompt needs at least one token; prompt {empty[0]} "
                         f"of the batch is empty")
    length = -(-max(len(p) for p in prompts) // bucket) * bucket
    tokens = torch.full((len(prompts), length), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p):] = torch.as_tensor(p, dtype=torch.long)
    return tokens, torch.tensor([len(p) for p in prompts], device=device)


@torch.no_grad()
def plain_generate(model, prompts, max_new_tokens: int, vocab_size: int, eos_ids=(),
                   temperature: float = 0.0, top_p: float = 1.0, generator=None,
                   top_k: int = 0, prompt_bucket: Optional[int] = None):
    """Plain (non-speculative) generation, greedy or sampled: continuations of `prompts`
    (lists of token ids), stopping a row at any id in `eos_ids` (not included in its
    result) or after `max_new_tokens`. `vocab_size` is the unpadded
    vocabulary. Greedy by default; `temperature` > 0 samples (after top-k, then top-p) from
    the last stage's `generator`, as decoding.sampling.Sampling does for speculative
    sampling; data synthesis uses it to draw diverse prompts. The batch is padded to a
    multiple of `prompt_bucket` tokens (left_pad). All model-parallel ranks call
    this with the same prompts; every rank returns the result."""
    from megatron_specdec.inference.sampling import Sampling
    from megatron_specdec.distributed import device

    sampler = Sampling(temperature, top_k, top_p)  # checks each setting, naming the bad one
    tokens, lengths = left_pad(prompts, 0, device(), prompt_bucket)
    batch = tokens.shape[0]
    runner = StageRunner(model, batch, tokens.shape[1] + max_new_tokens, vocab_size)
    eos = set(int(e) for e in eos_ids)
    done = [False] * batch  # host bookkeeping: a step's only device->host copy is its ids
    results = [[] for _ in range(batch)]
    rows = list(range(batch))  # the prompt each batch row answers
    step_input, counts = tokens, lengths
    for _ in range(max_new_tokens):
        out = runner.step(step_input, last_only=True, counts=counts, greedy=temperature == 0)
        if runner.last and temperature == 0:
            next_tokens = out[:, -1]
        elif runner.last:
            next_tokens = sampler.sample(out[:, -1], generator)
        else:
            next_tokens = torch.zeros(len(rows), dtype=torch.long, device=tokens.device)
        runner.broadcast_from_last(next_tokens)
        for i, (row, token) in enumerate(zip(rows, next_tokens.tolist())):
            if not done[i]:
                if token in eos:
                    done[i] = True
                else:
                    results[row].append(token)
        if all(done):
            break
        if temperature == 0 and sum(done) * _DROP_SHARE >= len(rows):
            # Finished rows leave the batch once they are a quarter of it: a long answer no
            # longer carries the compute of the short ones (the cache copy is paid a few times
            # a batch, not once a row). Sampling keeps every row, so that a seed draws what
            # it always drew.
            live = [i for i, stop in enumerate(done) if not stop]
            keep = torch.tensor(live, device=tokens.device)
            runner.keep_rows(keep)
            rows = [rows[i] for i in live]
            next_tokens, done = next_tokens[keep], [False] * len(live)
        step_input, counts = next_tokens.unsqueeze(1), None
    return results

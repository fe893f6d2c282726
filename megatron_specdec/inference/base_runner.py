"""The frozen base of a speculative model over a static KV cache, with the states the draft
reads: the captured residual stream of the aux layers (EAGLE3) and the final normed hidden
state (Medusa), delivered to the last pipeline stage.

`BaseRunner` composes generation.StageRunner (the cache, masks and stage-to-stage hand-off
of the plain greedy path), whose explicit stage forward records the residual stream after
the aux layers and the final normed state (no hooks). Under PP an aux layer
may live on an earlier stage: after each forward that stage sends its capture straight to
the last stage (same TP rank), in aux-id order, so the pairwise message order stays fixed.
"""

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_specdec.inference.draft_policy import COSTS
from megatron_specdec.inference.generation import StageRunner
from megatron_specdec.models import first_use


@dataclass
class BaseOutput:
    """Last stage only: logits [b, s, V] (full vocabulary), or for a greedy forward their
    argmax ids [b, s] in `ids` instead; aux [s, b, n_aux*h] (EAGLE3), hidden [s, b, h] (final
    normed state, Medusa)."""

    logits: Optional[Tensor]
    aux: Optional[Tensor]
    hidden: Optional[Tensor]
    ids: Optional[Tensor] = None

    def take(self, index: Tensor) -> "BaseOutput":
        """The draft inputs (aux, hidden) at positions index [b, n] (row b's own positions:
        its kept tokens); the logits stay behind, no drafter reads them."""
        def pick(states):
            if states is None:
                return None
            return states.gather(0, index.T[..., None].expand(-1, -1, states.shape[-1]))

        return BaseOutput(None, pick(self.aux), pick(self.hidden))

    def rows(self, rows: Tensor) -> "BaseOutput":
        """The batch rows `rows` only (finished rows leave the batch)."""
        def pick(states, dim):
            return None if states is None else states.index_select(dim, rows.to(states.device))

        return BaseOutput(pick(self.logits, 0), pick(self.aux, 1), pick(self.hidden, 1),
                          pick(self.ids, 0))

    @staticmethod
    def cat(outputs) -> "BaseOutput":
        """The draft inputs of several outputs' positions, in order."""
        first = outputs[0]
        return BaseOutput(None,
                          None if first.aux is None else torch.cat([o.aux for o in outputs]),
                          None if first.hidden is None else
                          torch.cat([o.hidden for o in outputs]))


class BaseRunner:
    def __init__(self, model, batch_size: int, max_length: int):
        """model: a SpeculativeGPTModel stage. Collective over the pipeline group."""
        from megatron.core import parallel_state as ps

        base = model.base
        self.aux_ids = list(model.aux_layer_ids)
        self.stage = StageRunner(base, batch_size, max_length, model.vocab_size,
                                 capture_ids=self.aux_ids,
                                 capture_final=model.method.captures_final)
        pp_group = ps.get_pipeline_model_parallel_group()
        owned = [layer.layer_number - 1 for layer in base.decoder.layers]
        per_stage = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(per_stage, owned, group=pp_group)
        stage_ranks = dist.get_process_group_ranks(pp_group)
        self.owner = {i: stage_ranks[s] for s, ids in enumerate(per_stage) for i in ids
                      if i in self.aux_ids}
        self.rank = dist.get_rank()

    @property
    def last(self) -> bool:
        return self.stage.last

    @property
    def single_stage(self) -> bool:
        """Whether this stage holds the whole model (no pipeline peers to keep in step)."""
        return self.stage.first and self.stage.last

    @property
    def lengths(self) -> Tensor:
        return self.stage.lengths

    def step(self, tokens: Tensor, positions=None, attention_mask=None,
             last_only: bool = False, counts=None, greedy: bool = False) -> Optional[BaseOutput]:
        """Append tokens [b, s] to the cache (positions, mask and counts: see
        StageRunner.step); the last stage gets a BaseOutput (with `last_only`, the logits of
        the last position only: a prefill needs no others; with `greedy`, argmax ids instead
        of logits)."""
        started, work = time.perf_counter(), first_use.count()
        logits = self.stage.step(tokens, last_only=last_only, positions=positions,
                                 attention_mask=attention_mask, counts=counts, greedy=greedy)
        # A prefill is no verify, nor is a forward that did first-use work a verify's cost:
        # neither is the policy's.
        if not last_only and first_use.count() == work:
            COSTS.record_base(tokens.shape[1], time.perf_counter() - started)
        captured = self.stage.captured
        last_rank = self.stage.last_rank
        aux = []
        for i in self.aux_ids:
            if self.owner[i] == self.rank and not self.last:
                dist.send(captured[i].contiguous(), dst=last_rank)
            elif self.last:
                if self.owner[i] != self.rank:
                    s, b = tokens.shape[1], tokens.shape[0]
                    captured[i] = torch.empty(s, b, self.stage.hidden_size,
                                              dtype=self.stage.dtype, device=tokens.device)
                    dist.recv(captured[i], src=self.owner[i])
                aux.append(captured[i])
        if not self.last:
            return None
        return BaseOutput(None if greedy else logits, torch.cat(aux, dim=-1) if aux else None,
                          captured.get("final"), logits if greedy else None)

    def rewind(self, n):
        self.stage.rewind(n)

    def compact(self, start, slots: Tensor, counts=None):
        self.stage.compact(start, slots, counts)

    def keep_rows(self, rows: Tensor):
        self.stage.keep_rows(rows)

    def broadcast_from_last(self, tensor: Tensor) -> Tensor:
        return self.stage.broadcast_from_last(tensor)

"""The speculative GPT model: a frozen megatron-core GPTModel plus a draft module.

`SpeculativeGPTModel` owns the base GPTModel unchanged (`self.base`) and, on the last
pipeline stage, the draft module under its method's name (`self.eagle3`, `self.medusa`, ...).
Its forward runs the base stage layer by layer (aux_capture) so captured states reach the
draft through the pipeline schedule, then on the last stage computes the draft's loss (the
method's `loss` hook, registry.DraftMethod).

Checkpoint keys of the base are exactly a base checkpoint's (embedding.*, decoder.*,
output_layer.*); the draft adds `<method name>.*`. A base checkpoint therefore loads
into the base half, and a speculative checkpoint reshards like any dist checkpoint.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron.core.transformer.module import MegatronModule

from megatron_specdec import registry
from megatron_specdec.models.layers import aux_capture, losses
from megatron_specdec.models.packing import packed_seq_params_of_mask


class SpeculativeGPTModel(MegatronModule):
    def __init__(self, base, spec_cfg, draft: Optional[MegatronModule], vocab_size: int):
        super().__init__(config=base.config)
        self.base = base
        self.spec_config = spec_cfg
        self.algo = spec_cfg.algo
        self.vocab_size = vocab_size
        self.model_type = base.model_type
        self.pre_process = base.pre_process
        self.post_process = base.post_process
        self.method = registry.get(self.algo)
        self.aux_layer_ids = self.method.aux_layer_ids(spec_cfg)
        self.carries_embeds = self.method.carries_embeds
        self.loss_chunk_rows = losses.LOSS_CHUNK_ROWS  # scored positions whose logits exist at once
        self.scored_rows_bucket = 1  # scored positions rounded up to a multiple (losses.bucket_rows)
        # Read by megatron's finalize_model_grads: the frozen base's tied embedding has no
        # gradient to all-reduce between the first and last stage.
        self.share_embeddings_and_output_weights = False
        if draft is not None:
            self.add_module(self.algo, draft)
        self.input_tensor = None
        for p in self.base.parameters():
            p.requires_grad_(False)

    @property
    def draft(self) -> Optional[MegatronModule]:
        """The draft module (last pipeline stage only)."""
        return getattr(self, self.algo, None)

    # ---- pipeline plumbing -------------------------------------------------------------
    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    @property
    def num_slots(self) -> int:
        return aux_capture.num_slots(self.carries_embeds, len(self.aux_layer_ids))

    def pipeline_seq_length(self, seq_length: int) -> int:
        """The `seq_length` to give the pipeline schedule: the stage tensor stacks slots."""
        return self.num_slots * seq_length

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    # ---- forward ----------------------------------------------------------------------
    def rotary_pos_emb(self, seq_len: int) -> Tensor:
        return self.base.rotary_pos_emb(seq_len)

    def run_base(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None):
        """This stage of the frozen base. Returns the StageState after its layers."""
        base = self.base
        b, s = input_ids.shape
        if self.pre_process:
            with torch.no_grad():
                embeds = base.embedding(input_ids=input_ids, position_ids=None)
            state = aux_capture.StageState(
                embeds, embeds if self.carries_embeds else None, [None] * len(self.aux_layer_ids)
            )
        else:
            first = base.decoder.layers[0].layer_number - 1 if len(base.decoder.layers) else 0
            state = aux_capture.StageState.unpack(
                self.input_tensor, self.carries_embeds, len(self.aux_layer_ids),
                [i < first for i in self.aux_layer_ids],
            )
        rotary = self.rotary_pos_emb(s)
        if attention_mask is None or self.config.transformer_impl != "transformer_engine":
            return aux_capture.run_layers(base.decoder.layers, state, self.aux_layer_ids,
                                          attention_mask, rotary)
        # Transformer Engine's layers are declared causal and ignore an explicit mask: packed
        # rows go as megatron's THD format, the batch one sequence of b*s tokens [b*s, 1, h]
        # with cu_seqlens, and come back to [s, b, h] for the stage tensor and the draft.
        packed = packed_seq_params_of_mask(attention_mask.expand(b, -1, -1, -1))

        def thd(t):
            return None if t is None else t.transpose(0, 1).reshape(b * s, 1, -1)

        def sbh(t):
            return None if t is None else t.reshape(b, s, -1).transpose(0, 1)

        out = aux_capture.run_layers(
            base.decoder.layers,
            aux_capture.StageState(thd(state.residual), state.embeds, [thd(a) for a in state.aux]),
            self.aux_layer_ids, None, rotary, packed)
        return aux_capture.StageState(sbh(out.residual), out.embeds, [sbh(a) for a in out.aux])

    @torch.no_grad()
    def base_head(self, residual: Tensor):
        """(final hidden [s, b, h], this rank's base logits [s, b, Vp/TP]) on the last stage."""
        base = self.base
        hidden = base.decoder.final_layernorm(residual)
        tied = base.share_embeddings_and_output_weights
        weight = base.shared_embedding_or_output_weight() if tied else None
        logits, _ = base.output_layer(hidden, weight=weight)
        return hidden, logits

    def forward(self, input_ids: Tensor, loss_mask: Tensor, attention_mask: Optional[Tensor] = None):
        """input_ids, loss_mask [b, s] (loss_mask token aligned: 1 = token t is a target);
        attention_mask: optional [b|1, 1, s, s] bool, True = may not attend (default causal).
        Returns the stage tensor on earlier stages, the loss dict on the last."""
        state = self.run_base(input_ids, attention_mask)
        if not self.post_process:
            return self._link(state.pack())
        out = self.draft_loss(state, input_ids, loss_mask, attention_mask)
        out["loss_sum"] = self._link(out["loss_sum"])
        return out

    def _link(self, out: Tensor) -> Tensor:
        return out if self.pre_process else aux_capture.link_to_input(out, self.input_tensor)

    def draft_loss(self, state, input_ids, loss_mask, attention_mask) -> dict:
        """The draft's loss report from the last stage's base state (online forward and the
        offline trainer, which replays dumped states, share it): the method's loss."""
        return self.method.loss(self, state, input_ids, loss_mask, attention_mask)

    # ---- checkpoints ------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Base keys as in a base checkpoint; draft keys under its algorithm name."""
        out = {
            f"base.{k}": v
            for k, v in self.base.sharded_state_dict(prefix, sharded_offsets, metadata).items()
        }
        if self.draft is not None:
            out.update(self.draft.sharded_state_dict(f"{prefix}{self.algo}.", sharded_offsets,
                                                     metadata))
        return out


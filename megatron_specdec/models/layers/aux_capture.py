"""Running the frozen base stage layer by layer, capturing the residual stream after chosen
layers, and carrying the captures to the last pipeline stage through the schedule.

Between stages the schedule sends one tensor. Here it is the stack along the sequence axis
of `slots` tensors [s, b, h]: the residual stream, then (EAGLE3) the base token embeddings
the draft needs on the last stage, then one slot per captured layer (zeros until the stage
owning that layer fills it). The pipeline schedule therefore runs with
`seq_length = slots * s`; nothing else about it changes.

The base is frozen, so its layers run under no_grad (no activations kept) and received
tensors are plain data. The schedule still sends every later stage's input gradient back;
`link_to_input` gives it zeros without running the base backwards.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor


@dataclass
class StageState:
    """What flows through the base stages: residual stream, embeddings, captured layers."""

    residual: Tensor
    embeds: Optional[Tensor]
    aux: List[Optional[Tensor]]

    def pack(self) -> Tensor:
        like = self.residual
        slots = [self.residual]
        if self.embeds is not None:
            slots.append(self.embeds)
        slots += [a if a is not None else torch.zeros_like(like) for a in self.aux]
        return torch.cat(slots, dim=0)

    @classmethod
    def unpack(cls, packed: Tensor, carries_embeds: bool, num_aux: int,
               aux_filled: List[bool]) -> "StageState":
        slots = list(packed.detach().chunk(1 + int(carries_embeds) + num_aux, dim=0))
        residual = slots.pop(0)
        embeds = slots.pop(0) if carries_embeds else None
        aux = [slot if filled else None for slot, filled in zip(slots, aux_filled)]
        return cls(residual, embeds, aux)


def num_slots(carries_embeds: bool, num_aux: int) -> int:
    return 1 + int(carries_embeds) + num_aux


def run_layers(layers, state: StageState, aux_layer_ids: List[int], attention_mask,
               rotary_pos_emb, packed_seq_params=None) -> StageState:
    """Run this stage's base layers (global ids from `layer.layer_number`), storing the
    output of each layer named in `aux_layer_ids` (0-based output-of-layer convention).
    `packed_seq_params` goes to every layer as megatron passes it (THD states)."""
    residual = state.residual
    aux = list(state.aux)
    with torch.no_grad():
        for layer in layers:
            residual, _ = layer(hidden_states=residual, attention_mask=attention_mask,
                                rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params)
            for slot, layer_id in enumerate(aux_layer_ids):
                if layer_id == layer.layer_number - 1:
                    aux[slot] = residual
    return StageState(residual, state.embeds, aux)


class _ZeroGradLink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, stage_input):
        ctx.input_meta = (stage_input.shape, stage_input.dtype, stage_input.device)
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.input_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def link_to_input(out: Tensor, stage_input: Tensor) -> Tensor:
    """`out`, made to return a zero gradient for the received stage tensor: nothing before
    this stage learns, but the pipeline schedule expects an input gradient to send back."""
    return _ZeroGradLink.apply(out, stage_input)

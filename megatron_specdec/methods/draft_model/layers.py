"""A separate draft GPT as the trainable half of a SpeculativeGPTModel (algo `draft_model`):
distilled against the frozen base, then used by the draft_model drafter.

The draft runs whole (TP=1, PP=1) and replicated on every rank of the base's last pipeline
stage, in process groups of one rank each, as the drafter runs it (see
methods/draft_model/proposer.py for why). Replicas see the same inputs and the same gathered
base logits, so their gradients agree without a message; a checkpoint stores them once (TP
rank 0 of data-parallel rank 0 is the main replica) and the gradient norm counts them once.
"""

from torch import Tensor

from megatron.core import parallel_state as ps
from megatron.core.transformer.module import MegatronModule


class DraftGPT(MegatronModule):
    def __init__(self, gpt):
        super().__init__(config=gpt.config)
        self.gpt = gpt
        self.group = gpt.pg_collection.tp  # this rank alone: losses reduce over nothing
        for p in gpt.parameters():
            p.tensor_model_parallel = False  # whole on every TP rank: clip_grad_norm counts it once

    def logits(self, input_ids: Tensor, attention_mask, rows: Tensor) -> Tensor:
        """Logits [n, Vp] at flat positions `rows` of the s-major [s*b] grid of input_ids
        [b, s]; the head runs on those rows only."""
        gpt = self.gpt
        b, s = input_ids.shape
        hidden = gpt.embedding(input_ids=input_ids, position_ids=None)
        hidden = gpt.decoder(hidden_states=hidden, attention_mask=attention_mask,
                             rotary_pos_emb=gpt.rotary_pos_emb(s))
        tied = gpt.share_embeddings_and_output_weights
        weight = gpt.shared_embedding_or_output_weight() if tied else None
        logits, _ = gpt.output_layer(hidden.reshape(s * b, 1, -1)[rows], weight=weight)
        return logits[:, 0]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The GPT's keys under `prefix` + 'gpt.', marked as replicas of one copy."""
        return replicas(self.gpt.sharded_state_dict(f"{prefix}gpt.", sharded_offsets, metadata))


def replicas(sharded_state_dict: dict) -> dict:
    """Mark the entries of a module every TP and DP rank holds whole: only TP rank 0 of DP
    rank 0 writes it (its own groups of one rank would make every rank the main replica)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    replica = (0, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank())
    for value in nested_values(sharded_state_dict):
        if hasattr(value, "replica_id"):
            value.replica_id = replica
    return sharded_state_dict


"""The base's token embedding, available on the last pipeline stage for the EAGLE3 draft.

Each draft step embeds the token it just drafted, on the last stage, where the draft lives.
At PP=1 that is the base's own embedding. Under PP the last stage has none, so it builds a
frozen replica of the base's LanguageModelEmbedding and receives the first stage's weight
shard (same TP rank) once. The alternative, a round trip through the first stage on every
draft step, would put 2 * (k - 1) pipeline messages on the draft's critical path; the replica
costs one vocab x h / TP weight on the last stage (the engines share the target's table the
same way).
"""

import torch
import torch.distributed as dist


def last_stage_embedding(model):
    """The embedding module [b, s] ids -> [s, b, h] on the last stage, None elsewhere.
    Collective over the pipeline group."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    from megatron_specdec.distributed import device

    base = model.base
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if first and last:
        return base.embedding
    if first:
        dist.send(base.embedding.word_embeddings.weight.detach().contiguous(),
                  dst=ps.get_pipeline_model_parallel_last_rank())
        return None
    if not last:
        return None
    replica = LanguageModelEmbedding(
        config=base.config, vocab_size=base.vocab_size,
        max_sequence_length=base.max_sequence_length,
        position_embedding_type=base.position_embedding_type,
    ).to(device())
    replica.requires_grad_(False).eval()
    weight = replica.word_embeddings.weight
    with torch.no_grad():
        dist.recv(weight.data, src=ps.get_pipeline_model_parallel_first_rank())
    return replica

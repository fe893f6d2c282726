"""Packed rows (several sequences in one row) in the two forms megatron-core attends with:
a block-diagonal mask for local attention, PackedSeqParams (THD) for Transformer Engine. The
data pipeline builds packed batches; the speculative model reads their masks."""

import torch


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """Causal, block-diagonal mask [b, 1, s, s] from segment_ids [b, s], in Megatron's
    convention (True = may NOT attend). Padding attends within itself, so no row is all-masked."""
    s = segment_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return ~(same & causal)[:, None]


def packed_seq_params(segment_ids: torch.Tensor):
    """megatron `PackedSeqParams` (THD, `cu_seqlens`) for a batch [b, s] flattened to one
    sequence of b*s tokens: the form Transformer Engine attention applies (TE attention declared
    causal ignores an explicit mask). A sequence starts at each row and each change of
    segment id; a row's right padding (segment 0) is its own sequence, as in
    `packed_attention_mask`, which this equals block for block."""
    from megatron.core.packed_seq_params import PackedSeqParams

    flat = segment_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[:: segment_ids.shape[-1]] = True  # rows never continue one another
    bounds = torch.cat([starts.nonzero().flatten(), flat.new_tensor([flat.numel()])])
    cu_seqlens = bounds.to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def packed_seq_params_of_mask(attention_mask: torch.Tensor):
    """`packed_seq_params` of the rows a `packed_attention_mask` [b, 1, s, s] describes (a
    sequence starts where a position may not see the one before). Any other mask is refused:
    Transformer Engine's layers would apply their own causal mask instead of it."""
    b, _, s, _ = attention_mask.shape
    u = torch.arange(1, s, device=attention_mask.device)
    starts = torch.ones(b, s, dtype=torch.long, device=attention_mask.device)
    starts[:, 1:] = attention_mask[:, 0, u, u - 1].long()
    segment_ids = starts.cumsum(-1)
    if not torch.equal(packed_attention_mask(segment_ids), attention_mask):
        raise ValueError(
            "attention_mask: Transformer Engine base layers take packed sequences "
            "(PackedSeqParams) only; expected a causal block-diagonal mask as "
            "packed_attention_mask builds, got another [b, 1, s, s] mask")
    return packed_seq_params(segment_ids)

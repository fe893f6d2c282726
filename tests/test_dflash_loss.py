"""DFlash loss pieces: anchors are drawn from the batch's tokens (same batch, same anchors;
only positions whose next token is scored), a packed row's block scores only its own
sequence's tokens, and the attention a loss builds grows linearly with the sequence."""

import torch

from megatron_specdec.methods.dflash.layers import block_attention_mask
from megatron_specdec.methods.dflash.loss import block_targets, sample_anchors


def test_anchors_follow_the_tokens_and_the_loss_mask():
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 32)
    mask[:, :10] = 0  # a prompt: its tokens are not targets
    a1, v1 = sample_anchors(ids, mask, 4, 6)
    a2, v2 = sample_anchors(ids.clone(), mask, 4, 6)
    assert torch.equal(a1, a2) and bool(v1.all())
    assert bool((a1 >= 9).all())  # token a+1 is scored
    other, _ = sample_anchors(ids.roll(1, dims=1), mask, 4, 6)
    assert not torch.equal(a1, other)


def test_packed_row_scores_only_the_anchors_sequence():
    ids, scored_mask = torch.arange(8)[None], torch.ones(1, 8)
    packed = torch.ones(8, 8, dtype=torch.bool).tril().logical_not()  # True = masked
    packed[4:, :4] = True  # sequences 0-3 and 4-7
    anchors, valid = torch.tensor([[2]]), torch.tensor([[True]])
    targets, scored = block_targets(ids, scored_mask, anchors, valid, 4, packed[None, None])
    assert targets.tolist() == [[[3, 4, 5]]] and scored.tolist() == [[[True, False, False]]]
    mask = block_attention_mask(anchors, 4, 8, packed[None, None])
    assert mask[0, 0, :, :2].logical_not().all() and mask[0, 0, :, 2:8].all()  # context < a


def test_attention_grows_linearly_with_the_sequence():
    anchors = torch.zeros(1, 8, dtype=torch.long)
    sizes = [block_attention_mask(anchors, 8, s).numel() for s in (512, 1024, 2048)]
    assert sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0])  # affine in s, not quadratic

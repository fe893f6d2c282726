"""The EAGLE3 training loss as trained: the position mask of upstream EAGLE-3, and the fast
path (TTT attention through SDPA, lm_head / base head / soft cross-entropy on scored rows
only) against the dense computation it replaced, in fp32: losses and gradients within 1e-5,
in one process and at TP=2."""

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.models.layers import losses
from megatron_specdec.methods.eagle3.layers import shift_right

from test_eagle3_unit import _tiny_model, dense_ttt_mask


def test_positions_outside_the_draft_vocabulary_add_no_loss_but_count(one_process):
    """Base top-1 outside the draft vocabulary: no loss, no gradient, still in the accuracy's
    denominator (upstream: loss mask t2d[argmax(target)], accuracy over all loss positions)."""
    g = torch.Generator().manual_seed(0)
    n, vocab, draft = 6, 20, 8
    target_ids = torch.arange(0, 16, 2)  # even ids are in the draft vocabulary
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    base = torch.randn(n, 1, vocab, generator=g)
    base[[1, 4], 0, 17] = 50.0  # top-1 = 17: odd, outside
    base[[0, 2, 3, 5], 0, 4] = 50.0  # top-1 = 4: draft id 2
    logits = torch.randn(n, 1, draft, generator=g)
    logits[:, 0, 2] = 30.0  # the draft's top-1 is draft id 2 everywhere
    logits.requires_grad_()
    masks = torch.ones(2, n)
    target, base_top = losses.eagle3_targets(base[:, 0], target_ids, draft, 0, vocab)
    # the draft's "hidden states" are its logits (identity head), scored 4 rows at a time
    out = losses.eagle3_loss([logits, logits], lambda h: h, target, base_top, masks,
                             target_ids, t2d, 0, 0.8, chunk_rows=4)
    out["loss_sum"].backward()
    assert (logits.grad[[1, 4]] == 0).all() and (logits.grad[[0, 2, 3, 5]] != 0).any()
    assert out["step_count"].tolist() == [6, 6] and out["step_correct"].tolist() == [4, 4]
    assert int(out["num_tokens"]) == 6
    p = torch.softmax(base[:, 0, target_ids], -1)
    ce = -(p * torch.log_softmax(logits.detach()[:, 0], -1)).sum(-1)
    assert torch.allclose(out["step_loss"][0], ce[[0, 2, 3, 5]].sum(), atol=1e-5)


def _dense_loss(model, ids, loss_mask, attention_mask):
    """The loss as computed before the fast path: dense TTT masks over every block's keys,
    draft and base logits at every position, then the scored positions picked by mask."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather

    draft, cfg = model.draft, model.spec_config
    b, s = ids.shape
    state = model.run_base(ids, attention_mask)
    _, base_logits = model.base_head(state.residual)
    base_logits = gather(base_logits)  # [s, b, V]: whole vocabularies at any TP
    following = torch.cat([base_logits[1:], base_logits[-1:]]).reshape(s * b, -1)
    target_ids = draft.target_ids()
    p = torch.softmax(following[:, target_ids], -1)
    in_vocab = draft.t2d[following.argmax(-1)].float()
    masks = losses.chain_masks(loss_mask, attention_mask, cfg.ttt_steps)
    hidden = draft.project(torch.cat(state.aux, -1))
    embeds = torch.cat([state.embeds[1:], state.embeds[-1:]])
    kv = [[] for _ in draft.layers]
    total = 0.0
    for k in range(cfg.ttt_steps):
        if k:
            hidden = shift_right(hidden)
        hidden, logits = draft.step(embeds, hidden, model.rotary_pos_emb(s),
                                    dense_ttt_mask(attention_mask, s, k), kv)
        logits = gather(logits).reshape(s * b, -1)
        log_q = torch.log_softmax(logits[:, :draft.draft_vocab_size], -1)
        ce = -(p * log_q).sum(-1)
        total = total + cfg.ttt_decay ** k * (ce * masks[k] * in_vocab).sum()
    return total


def _check_fast_equals_dense(packed):
    """This rank's draft gradients and the loss, fast against dense, within 1e-5: as built,
    then lean (the loss's logits 5 positions at a time, the draft layer recomputed)."""
    model, _, _ = _tiny_model(2)
    g = torch.Generator().manual_seed(3)
    b, s = 2, 12
    ids = torch.randint(0, 512, (b, s), generator=g)
    loss_mask = (torch.rand(b, s, generator=g) > 0.3).long()
    attention_mask = None
    if packed:
        seg = torch.tensor([[1] * 5 + [2] * 7, [1] * 8 + [2] * 4])
        attention_mask = ((seg[:, :, None] != seg[:, None, :])
                          | torch.ones(s, s, dtype=torch.bool).triu(1))[:, None]
    params = [p for p in model.draft.parameters() if p.requires_grad]
    dense = _dense_loss(model, ids, loss_mask, attention_mask)
    dense_grads = torch.autograd.grad(dense, params)
    for lean, bucket in ((False, 1), (True, 1), (False, 7)):
        model.loss_chunk_rows = 5 if lean else losses.LOSS_CHUNK_ROWS
        model.draft.recompute = lean
        model.scored_rows_bucket = bucket  # 7: the scored rows padded, the padding masked out
        fast = model(ids, loss_mask, attention_mask)["loss_sum"]
        fast_grads = torch.autograd.grad(fast, params)
        assert float(fast) > 0 and torch.allclose(fast, dense, rtol=1e-5, atol=1e-5), (lean, bucket)
        for name_grad, (a, w) in enumerate(zip(fast_grads, dense_grads)):
            assert torch.allclose(a, w, rtol=1e-5, atol=1e-5), (lean, bucket, name_grad)


@pytest.mark.parametrize("packed", [False, True])
def test_fast_loss_equals_dense_loss_and_gradients(one_process, packed):
    _check_fast_equals_dense(packed)


def _tp2_worker():
    distributed.initialize(2, 1)
    for packed in (False, True):
        _check_fast_equals_dense(packed)


def test_fast_loss_equals_dense_loss_and_gradients_tp2():
    """Each rank (2 heads of 1 query group, half of each vocabulary) against the dense loss
    over gathered logits: packed and unpacked (a failed check fails the spawn)."""
    distributed.spawn(_tp2_worker, 2)

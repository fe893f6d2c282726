"""Module-level functions run on N local processes by megatron_specdec.distributed.spawn."""

import torch

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec import distributed
from megatron_specdec.inference.generation import StageRunner, plain_generate
from megatron_specdec.loading.hf_conversion import model_from_hf
from megatron_specdec.loading.source import load_model


def is_writer():
    """The rank that holds full results: last pipeline stage, first TP rank."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0


def parity(tp, pp, hf_dir, prompt_ids, new_tokens, out_file):
    """Prompt logits (KV-cache prefill) and greedy tokens of the Megatron model at TP x PP."""
    distributed.initialize(tp, pp)
    model, config = model_from_hf(hf_dir)
    model.eval()
    runner = StageRunner(model, 1, len(prompt_ids), config.vocab_size)
    logits = runner.step(torch.tensor([prompt_ids]))
    tokens = plain_generate(model, [prompt_ids], new_tokens, config.vocab_size)[0]
    forward = forward_logits(model, prompt_ids, config.vocab_size) if pp == 1 else None
    if is_writer():
        torch.save({"logits": logits[0], "tokens": tokens, "forward": forward}, out_file)


def forward_logits(model, prompt_ids, vocab_size):
    """The prompt's logits through GPTModel.forward (no cache, none of the decoding ops), so
    that a parity failure says whether the weights or the decoding path moved."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model(ids, torch.arange(len(prompt_ids))[None], None)
    return gather_from_tensor_model_parallel_region(out)[0, :, :vocab_size].float()


def lm_loss(model, tokens, loss_mask):
    """Mean next-token loss of `tokens` [b, s] through megatron's pipeline schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    inputs, labels, mask = tokens[:, :-1], tokens[:, 1:], loss_mask[:, 1:].float()
    b, s = inputs.shape
    positions = torch.arange(s).expand(b, s)

    def forward_step(data_iterator, model):
        per_token = model(inputs, positions, None, labels=labels)

        def loss_func(output):
            loss = (output.float() * mask).sum() / mask.sum()
            return loss, {"loss": loss.detach()}

        return per_token, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
        num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True,
    )
    return losses[0]["loss"] if losses else None  # only the last stage holds the loss


def checkpoint_loss(tp, pp, ckpt_dir, tokens, out_file):
    """Load a checkpoint at TP x PP and compute the loss on a fixed batch."""
    distributed.initialize(tp, pp)
    model = load_model(ckpt_dir, with_draft=False).model
    with torch.no_grad():
        loss = lm_loss(model, tokens, torch.ones_like(tokens))
    if is_writer():
        torch.save(loss, out_file)


def _moe_writer():
    """`is_writer` on the first data-parallel rank: with EP > 1 several ranks hold results."""
    from megatron.core import parallel_state as ps

    return is_writer() and ps.get_data_parallel_rank() == 0


def moe_parity(tp, pp, ep, hf_dirs, prompt_ids, new_tokens, out_file):
    """`parity` at TP x PP x EP for each HF directory in one process group: {dir: result}."""
    distributed.initialize(tp, pp, ep=ep)
    results = {}
    for hf_dir in hf_dirs:
        model, config = model_from_hf(hf_dir)
        model.eval()
        runner = StageRunner(model, 1, len(prompt_ids), config.vocab_size)
        logits = runner.step(torch.tensor([prompt_ids]))
        tokens = plain_generate(model, [prompt_ids], new_tokens, config.vocab_size)[0]
        results[hf_dir] = {"logits": logits[0] if logits is not None else None, "tokens": tokens}
    if _moe_writer():
        torch.save(results, out_file)


def moe_checkpoint_logits(tp, pp, ep, sources, prompt_ids, out_file):
    """Prompt logits of each base model source (dist checkpoint or HF directory) loaded at
    TP x PP x EP: {source: logits} (dist_checkpointing reshards a checkpoint's experts)."""
    distributed.initialize(tp, pp, ep=ep)
    results = {}
    for source in sources:
        loaded = load_model(source, with_draft=False)
        runner = StageRunner(loaded.model, 1, len(prompt_ids), loaded.hf_config.vocab_size)
        logits = runner.step(torch.tensor([prompt_ids]))
        results[source] = logits[0] if logits is not None else None
    if _moe_writer():
        torch.save(results, out_file)


def greedy_head_tp(vocab, weight, x, out_file):
    """output_argmax and output_argmax_confidence at TP=2, each rank holding half of the
    padded output `weight` (rows past `vocab` are padding)."""
    from megatron.core import parallel_state as ps

    from megatron_specdec.models.layers.greedy_head import (
        output_argmax,
        output_argmax_confidence,
    )

    distributed.initialize(2, 1)
    group = ps.get_tensor_model_parallel_group()
    rows = weight.shape[0] // 2
    mine = weight[group.rank() * rows:(group.rank() + 1) * rows].contiguous()
    ids = output_argmax(x, mine, vocab, group)
    confident = output_argmax_confidence(x, mine, vocab, group)
    if group.rank() == 0:
        torch.save({"ids": ids, "confident_ids": confident[0], "p": confident[1]}, out_file)

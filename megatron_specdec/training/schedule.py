"""The schedule driver: micro-batches through megatron's pipeline schedule, online (the base
runs in the step) or from stored base states (offline mode), and the reduction of the loss
reports the last stage returns. The model only computes; what runs when lives here."""

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_specdec.models.layers import aux_capture, losses


def forward_step(data_iterator, model):
    """Megatron `forward_step_func`: batches are dicts with input_ids and loss_mask [b, s]
    and optionally attention_mask."""
    batch = next(data_iterator)
    return model(batch["input_ids"], batch["loss_mask"], batch.get("attention_mask")), losses.loss_func


def forward_backward(model, batches, forward_only: bool = False):
    """Run `batches` (a list of micro-batches) through megatron's pipeline schedule.

    Returns the loss reports of the last stage (empty elsewhere). Gradients accumulate in
    the draft parameters' `.grad`."""
    b, s = batches[0]["input_ids"].shape
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=model.pipeline_seq_length(s),
        micro_batch_size=b,
        forward_only=forward_only,
    )


def _stored_forward_step(data_iterator, model):
    """`forward_step` over a batch carrying stored base states (`offline.StoredStates`): the
    embeddings are looked up again, the base layers do not run."""
    batch = next(data_iterator)
    ids = batch["input_ids"]
    with torch.no_grad():
        embeds = model.base.embedding(input_ids=ids, position_ids=None)
    residual = batch["residual"].transpose(0, 1).contiguous()
    aux = []
    if "aux" in batch:
        aux = list(batch["aux"].transpose(0, 1).contiguous().chunk(len(model.aux_layer_ids), -1))
    state = aux_capture.StageState(residual, embeds if model.carries_embeds else None, aux)
    out = model.draft_loss(state, ids, batch["loss_mask"], batch.get("attention_mask"))
    return out, losses.loss_func


def stored_forward_backward(model, batches):
    """`forward_backward` for stored states: the draft's loss and backward only (pp=1)."""
    b, s = batches[0]["input_ids"].shape
    return get_forward_backward_func()(
        forward_step_func=_stored_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=s, micro_batch_size=b, forward_only=False)


def forward_backward_func(recipe):
    """The driver of a recipe's training mode."""
    return forward_backward if recipe.training.mode == "online" else stored_forward_backward


def sum_reports(reports) -> dict:
    """Micro-batch loss reports summed key by key."""
    return {k: sum(r[k] for r in reports) for k in reports[0]}


def reduce_reports(reports) -> dict:
    """Sum micro-batch reports: mean loss per scored token and per-step top-1 accuracy."""
    if not reports:
        return {}
    total = sum_reports(reports)
    tokens = float(total["num_tokens"]) or 1.0
    return {
        "loss": float(total["loss_sum"]) / tokens,
        "step_loss": (total["step_loss"] / total["step_count"].clamp(min=1)).tolist(),
        "accuracy": losses.accuracies(total),
        "num_tokens": int(total["num_tokens"]),
    }

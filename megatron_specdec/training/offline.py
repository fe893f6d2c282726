"""Offline mode: run the frozen base over the training set once, store what the draft needs
from it, and train the draft from the stored states (no base layers in the training step).

Stored per dataset row (one file each, `states/<row>.pt`, written atomically, up to the
row's last non-padding token): the captured aux layers (EAGLE3) and the base's last residual
stream, in the model dtype. The base logits and token embeddings are recomputed from them
(final norm + output layer, embedding lookup: cheap). Each data-parallel rank dumps its own
rows, the last pipeline stage's first TP rank writes; a restarted dump skips finished rows.
`index.json`, written last, records what the states were computed from; a dump made from
other data or another model is refused. Training from stored states needs pp=1.
"""

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_specdec import distributed
from megatron_specdec.training.batches import STATE_KEYS, model_batch
from megatron_specdec.training.recipe import offline_dir

log = logging.getLogger(__name__)

INDEX = "index.json"


def training_dataset(recipe, model, tokenizer):
    """The dataset the trainer iterates: conversations, plus stored states in offline mode."""
    from megatron_specdec.data import ConversationDataset

    d = recipe.data
    dataset = ConversationDataset.from_files(list(d.train), tokenizer, d.seq_length, d.pack,
                                             d.seed, d.on_error)
    if recipe.training.mode == "online":
        return dataset
    directory = offline_dir(recipe)
    dump_states(model, dataset, directory, recipe)
    return StoredStates(dataset, directory / "states")


def _fingerprint(model, dataset, recipe) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([recipe.model.path, recipe.model.dtype, model.aux_layer_ids,
                         dataset.seq_length, len(dataset)]).encode())
    for i in range(len(dataset)):
        h.update(dataset[i]["input_ids"].numpy().tobytes())
    return h.hexdigest()


def _length(row: dict) -> int:
    """Positions up to the last non-padding token (padding is segment 0 at the end)."""
    nonpad = (row["segment_ids"] > 0).nonzero()
    return int(nonpad[-1]) + 1 if len(nonpad) else 1


def _writer() -> bool:
    return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0


def dump_states(model, dataset, directory: Path, recipe):
    """Collectively compute and store the base states of every row (skips finished rows)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fingerprint = _fingerprint(model, dataset, recipe)
    index = directory / INDEX
    if index.is_file():
        if json.loads(index.read_text())["fingerprint"] != fingerprint:
            raise ValueError(
                f"{directory} holds states of other data or another model; remove it or set "
                f"training.offline_dir to a new directory")
        return
    states = directory / "states"
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = recipe.training.micro_batch_size
    pending = [i for i in range(len(dataset)) if not (states / f"{i:08d}.pt").is_file()]
    box = [pending]
    dist.broadcast_object_list(box, src=0)  # every rank runs the same batches
    mine = box[0][rank::dp]  # data-parallel groups never talk during a forward pass
    if dist.get_rank() == 0:
        states.mkdir(parents=True, exist_ok=True)
        log.info("dumping base states of %d rows to %s", len(box[0]), states)
    dist.barrier()
    captured = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if not model.post_process:
            return model(batch["input_ids"], batch["loss_mask"], batch.get("attention_mask")), None
        captured.append(model.run_base(batch["input_ids"], batch.get("attention_mask")))
        zero = torch.zeros((), device=distributed.device(), requires_grad=True)
        return zero, lambda out: (out, {})

    for start in range(0, len(mine), mbs):
        rows = mine[start:start + mbs]
        items = [dataset[i] for i in rows]
        batch = model_batch({k: torch.stack([it[k] for it in items]) for k in items[0]},
                            recipe.data.pack)
        captured.clear()
        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter([batch]), model=[model],
                num_microbatches=1, seq_length=model.pipeline_seq_length(recipe.data.seq_length),
                micro_batch_size=len(rows), forward_only=True)
        if _writer():
            state = captured[0]
            for j, i in enumerate(rows):
                n = _length(items[j])
                record = {"residual": state.residual[:n, j].clone()}
                if state.aux:
                    record["aux"] = torch.cat([a[:n, j] for a in state.aux], -1).clone()
                tmp = states / f".{i:08d}.pt.tmp"
                torch.save(record, tmp)
                os.replace(tmp, states / f"{i:08d}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = directory / f".{INDEX}.tmp"
        tmp.write_text(json.dumps({"fingerprint": fingerprint, "rows": len(dataset)}))
        os.replace(tmp, index)
    dist.barrier()


class StoredStates(torch.utils.data.Dataset):
    """Dataset rows with their stored base states, zero-padded to seq_length."""

    def __init__(self, dataset, states_dir: Path):
        self.dataset, self.states_dir = dataset, states_dir

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        row = self.dataset[index]
        stored = torch.load(self.states_dir / f"{index:08d}.pt", weights_only=True)
        s = self.dataset.seq_length
        for key in STATE_KEYS:
            if key in stored:
                t = stored[key]
                row[key] = torch.cat([t, t.new_zeros(s - t.shape[0], t.shape[1])])
        return row


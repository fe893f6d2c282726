"""Training checkpoints: draft weights, AdamW state, trainer position and RNG, resumable at
another TP/PP layout, verified before use.

One checkpoint is a megatron_specdec dist checkpoint (`checkpoint.save_checkpoint`, written
under a temporary name and renamed into place) holding
  - the draft module's sharded tensors (the frozen base is not repeated: it comes from the
    recipe's model and is rebuilt on resume),
  - AdamW's exp_avg / exp_avg_sq as ShardedTensors shaped like their parameters (so they
    reshard with them), the shared AdamW step in the common state,
  - the trainer state (step, consumed samples, tokens) in the common state,
  - every rank's RNG states as one ShardedObject (restored when the world size matches).
After the rename, rank 0 adds `manifest.json` (size and sha256 of every file). A directory
without a manifest, or whose files do not match it, is refused on resume with the reason,
renamed aside to `<name>.corrupt` (never deleted), and the previous good one is used.
"""

import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_specdec import checkpoint
from megatron_specdec.distributed import device

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
_NAME = re.compile(r"^step_(\d{7,})$")


@dataclass
class TrainerState:
    step: int = 0
    consumed_samples: int = 0
    tokens: int = 0  # scored target tokens seen


def step_dir(directory, step: int) -> Path:
    return Path(directory) / f"step_{step:07d}"


# ---- RNG -----------------------------------------------------------------------------------
def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- sharded state -------------------------------------------------------------------------
def _init_adam_state(optimizer):
    """Zero AdamW state for every parameter, so a load has tensors of the right shapes."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.tensor(0.0),
                                      "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _sharded_state(model, optimizer, trainer: dict, rng: Optional[dict]) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    sd = {"trainer": trainer}
    if model.draft is not None:
        draft_sd = model.draft.sharded_state_dict(prefix=f"{model.algo}.")
        sd["model"] = draft_sd
        optim = optimizer.state_dict()
        steps = {float(s["step"]) for s in optim["state"].values()}
        if len(steps) > 1:
            raise RuntimeError(f"AdamW steps differ between parameters: {sorted(steps)}")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        optim_state_to_sharding_state(
            optim, get_param_id_to_sharded_param_map(draft_sd, params), exclude_keys=("step",)
        )
        sd["optimizer"] = {"state": optim["state"]}
    if rng is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
        sd["rng"] = ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0)
    return sd


def save(directory, step: int, model, optimizer, state: TrainerState, meta: dict,
         keep_last: int) -> Path:
    """Collectively write checkpoint `step`, then its manifest, then `latest`; prune the
    oldest good checkpoints beyond `keep_last`."""
    path = step_dir(directory, step)
    adam_step = 0.0
    if optimizer is not None:
        _init_adam_state(optimizer)
        adam_step = float(next(iter(optimizer.state.values()))["step"])
    # The common state is rank 0's, which may hold no draft: share the AdamW step.
    trainer = {"state": asdict(state), "adam_step": _max_over_world(adam_step)}
    meta = dict(meta, training_checkpoint=dict(meta.get("training_checkpoint", {}), step=step,
                                               world_size=dist.get_world_size()))
    checkpoint.save_checkpoint(model, path, meta, overwrite=True,
                               sharded_state_dict=_sharded_state(model, optimizer, trainer,
                                                                 rng_state()))
    if dist.get_rank() == 0:
        _write_json_atomic(path / MANIFEST, {"files": _file_table(path)})
        _write_text_atomic(Path(directory) / LATEST, path.name + "\n")
        for old in checkpoints_in(directory, with_manifest=True)[keep_last:]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def _max_over_world(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


# Draft keys a run may change on resume (they shape no tensor).
_RESUMABLE_CHANGES = ("ttt_steps", "ttt_decay", "medusa_head_weights")


def check_compatible(path, meta: dict, model):
    """Refuse a checkpoint whose draft (or base geometry) differs from the model's, naming
    the keys, before dist_checkpointing fails on a shape."""
    from megatron_specdec import spec_config

    saved = meta["training_checkpoint"]["draft"]
    mine = spec_config.to_dict(model.spec_config)
    diff = sorted(k for k in set(saved["config"]) | set(mine["config"])
                  if k not in _RESUMABLE_CHANGES
                  and saved["config"].get(k) != mine["config"].get(k))
    if saved["algo"] != mine["algo"]:
        diff.insert(0, "algo")
    base = {"hidden_size": model.config.hidden_size,
            "num_hidden_layers": model.config.num_layers, "vocab_size": model.vocab_size}
    diff += [f"base {k}" for k, v in base.items() if meta["hf_config"].get(k) != v]
    if diff:
        raise checkpoint.CheckpointError(
            f"{path} was trained with another draft or base: {', '.join(diff)} differ "
            f"(saved draft {saved}); use another checkpointing.directory")


def load(path, model, optimizer) -> TrainerState:
    """Restore draft weights, AdamW state and RNG from a verified checkpoint (any layout)."""
    from megatron.core import dist_checkpointing

    meta = checkpoint.read_meta(path)
    check_compatible(path, meta, model)
    same_world = meta["training_checkpoint"]["world_size"] == dist.get_world_size()
    if optimizer is not None:
        _init_adam_state(optimizer)
    template = _sharded_state(model, optimizer, {}, rng_state() if same_world else None)
    loaded = dist_checkpointing.load(template, str(path))
    if model.draft is not None:
        missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in missing if k.startswith(f"{model.algo}.")]
        if missing or unexpected:
            raise checkpoint.CheckpointError(
                f"{path}: draft weights do not match the model (missing {missing}, "
                f"unexpected {unexpected})")
        adam_step = torch.tensor(loaded["trainer"]["adam_step"])
        state = loaded["optimizer"]["state"]
        for param_state in state.values():
            param_state["step"] = adam_step.clone()
        optimizer.load_state_dict({"state": state,
                                   "param_groups": optimizer.state_dict()["param_groups"]})
    if same_world:
        set_rng_state(loaded["rng"])
    else:
        log.warning("%s was saved by %d ranks, resuming on %d: RNG states start fresh", path,
                    meta["training_checkpoint"]["world_size"], dist.get_world_size())
    return TrainerState(**loaded["trainer"]["state"])


# ---- verification and discovery ------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_table(path: Path) -> dict:
    return {str(f.relative_to(path)): {"size": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST}


def verify(path) -> None:
    """Raise CheckpointError saying what is wrong with checkpoint `path`, if anything."""
    path = Path(path)
    checkpoint.read_meta(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise checkpoint.CheckpointError(f"{path}: {MANIFEST} is missing (save interrupted)")
    try:
        expected = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise checkpoint.CheckpointError(f"{manifest} is corrupt: {e}") from None
    for name, entry in expected.items():
        f = path / name
        if not f.is_file():
            raise checkpoint.CheckpointError(f"{path}: file {name} is missing")
        if f.stat().st_size != entry["size"]:
            raise checkpoint.CheckpointError(
                f"{path}: file {name} is truncated or altered ({f.stat().st_size} bytes, "
                f"expected {entry['size']})")
        if _sha256(f) != entry["sha256"]:
            raise checkpoint.CheckpointError(f"{path}: file {name} is corrupt (sha256 mismatch)")


def checkpoints_in(directory, with_manifest: bool = False) -> list:
    """`step_*` checkpoint directories, newest first (not verified)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _NAME.match(p.name)) and p.is_dir()
             and (not with_manifest or (p / MANIFEST).is_file())]
    return [p for _, p in sorted(found, reverse=True)]


def find_resumable(directory) -> Optional[Path]:
    """The newest checkpoint that verifies (decided on rank 0, shared with every rank).
    Each newer one that fails is reported and renamed aside to `<name>.corrupt`."""
    choice = None
    if dist.get_rank() == 0:
        for path in checkpoints_in(directory):
            try:
                verify(path)
            except checkpoint.CheckpointError as e:
                aside = path.with_name(f"{path.name}.corrupt")
                n = 1
                while aside.exists():
                    aside, n = path.with_name(f"{path.name}.corrupt{n}"), n + 1
                log.error("refusing checkpoint: %s; moved it to %s and trying the previous one",
                          e, aside.name)
                os.rename(path, aside)
                continue
            choice = str(path)
            break
    box = [choice]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] else None


def _write_text_atomic(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json_atomic(path: Path, obj):
    _write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))

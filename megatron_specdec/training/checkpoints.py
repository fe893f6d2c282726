"""Training checkpoints: draft weights, optimizer state, trainer position and RNG, resumable at
another TP/PP layout, verified before use, loaded without unpickling anything.

One checkpoint is a megatron_specdec dist checkpoint (`checkpoint.save_checkpoint`, committed
atomically) holding
  - the draft module's sharded tensors (the frozen base is not repeated: it comes from the
    recipe's model and is rebuilt on resume),
  - AdamW's exp_avg / exp_avg_sq, and the fp32 master weights of a bf16/fp16 draft, as
    ShardedTensors shaped like their parameters (so they reshard with them),
  - every rank's RNG states as tensors (`rng.<name>`, one row per rank, restored when the
    world size matches),
and, in `specdec_checkpoint.json` under `training_checkpoint`: the trainer state (step,
consumed samples, tokens), the shared AdamW step, the float16 loss scale, and the base
model's fingerprint (base_fingerprint), compared on resume. Nothing is a pickled object: a
checkpoint holding one is refused unread (pickle_guard).
After the commit, rank 0 adds `manifest.json` (size and sha256 of every file). A directory
without a manifest, or whose files do not match it, is refused on resume with the reason,
renamed aside to `<name>.corrupt` (never deleted), and the previous good one is used.
"""

import dataclasses
import errno
import json
import logging
import math
import os
import random
import re
import resource
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_specdec.checkpointing import checkpoint, pickle_guard
from megatron_specdec.distributed import device
from megatron_specdec.training import base_fingerprint, data_fingerprint
from megatron_specdec.checkpointing.hf_files import FileFormatError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = 2  # 1 stored RNG states as a pickled ShardedObject
_NAME = re.compile(r"^step_(\d{7,})$")


@dataclass
class TrainerState:
    step: int = 0
    consumed_samples: int = 0
    tokens: int = 0  # scored target tokens seen


def step_dir(directory, step: int) -> Path:
    return Path(directory) / f"step_{step:07d}"


def step_of(path) -> int:
    """The step of a `step_dir` path."""
    return int(_NAME.match(Path(path).name).group(1))


# ---- RNG -----------------------------------------------------------------------------------
def rng_tensors() -> dict:
    """This rank's RNG states as tensors: torch's, the model-parallel tracker's, CUDA's, and
    Python's Mersenne Twister words with its cached gauss (NaN for none)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    _, words, gauss = random.getstate()
    state = {"python": torch.tensor(words, dtype=torch.int64),
             "python_gauss": torch.tensor([math.nan if gauss is None else gauss],
                                          dtype=torch.float64),
             "torch": torch.get_rng_state()}
    state.update({f"tracker.{name}": t.cpu()
                  for name, t in get_cuda_rng_tracker().get_states().items()})
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_tensors(state: dict):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    gauss = float(state["python_gauss"][0])
    random.setstate((3, tuple(state["python"].tolist()), None if math.isnan(gauss) else gauss))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states({k[len("tracker."):]: v for k, v in state.items()
                                       if k.startswith("tracker.")})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- sharded state -------------------------------------------------------------------------
def _sharded_state(model, optimizer, rng: Optional[dict]) -> dict:
    """The draft's sharded state (its `_extra_state` objects are left out by checkpoint's save
    and load), its optimizer state and the RNG rows."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd = {}
    if model.draft is not None:
        draft_sd = model.draft.sharded_state_dict(prefix=f"{model.algo}.")
        sd["model"] = draft_sd
        sd["optimizer"] = optimizer.sharded_state_dict(draft_sd)
    if rng is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
        sd["rng"] = {k: ShardedTensor.from_rank_offsets(f"rng.{k}", t[None], (0, rank, world),
                                                        replica_id=0)
                     for k, t in rng.items()}
    return sd


def save(directory, step: int, model, optimizer, state: TrainerState, meta: dict,
         keep_last: int) -> Path:
    """Collectively write checkpoint `step`, then its manifest, then `latest`; prune the
    oldest good checkpoints beyond `keep_last`. `meta["training_checkpoint"]` carries the
    draft config and base fingerprint."""
    path = step_dir(directory, step)
    # The JSON is rank 0's, which may hold no draft: share the AdamW step.
    record = dict(meta["training_checkpoint"], format=FORMAT, step=step,
                  world_size=dist.get_world_size(), trainer=asdict(state),
                  adam_step=max_over_world(optimizer.adam_step()),
                  loss_scale=optimizer.loss_scale_state())
    try:
        checkpoint.save_checkpoint(model, path, dict(meta, training_checkpoint=record),
                                   overwrite=True,
                                   sharded_state_dict=_sharded_state(model, optimizer,
                                                                     rng_tensors()))
        if dist.get_rank() == 0:
            _write_json_atomic(path / MANIFEST, {"files": _file_table(path)})
    except WRITE_ERRORS as e:
        raise checkpoint.CheckpointError(
            f"writing checkpoint {path} failed ({write_failure(e, path)}); {LATEST} still names "
            f"{_latest_name(directory)}, which a resume uses") from e
    if dist.get_rank() == 0:
        checkpoint.write_text_atomic(Path(directory) / LATEST, path.name + "\n")
        for old in checkpoints_in(directory, with_manifest=True)[keep_last:]:
            checkpoint.remove_dir(old)
    dist.barrier()
    return path


# What a failed write raises: torch's dist checkpoint writer reports a worker's OSError as a
# CheckpointException, which derives from BaseException.
WRITE_ERRORS = (Exception, CheckpointException)


def _causes(e: BaseException) -> list:
    """`e`, what it was raised from, and the per-rank errors a CheckpointException holds."""
    out, todo = [], [e]
    while todo:
        seen = todo.pop()
        if seen is None or any(seen is o for o in out):
            continue
        out.append(seen)
        todo += [seen.__cause__, seen.__context__]
        for failure in getattr(seen, "failures", {}).values():  # {rank: (error, traceback)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return out


def write_failure(e: BaseException, target) -> str:
    """Why a write under `target` failed: the OS error under it (dist_checkpointing wraps it,
    sometimes in another process's words) and what bounds writes there: the free space and a
    file-size limit (`ulimit -f`), if one is set."""
    reason = None
    for seen in _causes(e):
        for code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            if getattr(seen, "errno", None) == code or os.strerror(code) in str(seen):
                reason = os.strerror(code)
    if reason is None:
        inner = _causes(e)[-1]
        text = str(inner).strip().splitlines()
        reason = f"{type(inner).__name__}: {text[-1] if text else ''}"
    where = Path(target)
    while not where.exists() and where != where.parent:
        where = where.parent
    bounds = [f"{shutil.disk_usage(where).free / 2**20:.0f} MiB free on {where}"]
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        bounds.append(f"a file-size limit of {limit} bytes (ulimit -f)")
    return f"{reason}; {', '.join(bounds)}"


def _latest_name(directory) -> str:
    latest = Path(directory) / LATEST
    return latest.read_text().strip() if latest.is_file() else "no checkpoint"


def max_over_world(value: float) -> float:
    """The largest `value` over all ranks (collective), for decisions every rank must share."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)




def check_compatible(path, meta: dict, model):
    """Refuse a checkpoint of another format or whose draft differs from the model's, naming
    the keys, before dist_checkpointing fails on a shape."""
    from megatron_specdec import registry

    record = meta["training_checkpoint"]
    if record.get("format") != FORMAT:
        raise checkpoint.CheckpointError(
            f"{path}/{checkpoint.META_FILE}: training_checkpoint.format is "
            f"{record.get('format')!r}, expected {FORMAT} (format 1 kept RNG states as a "
            f"pickle, which is not loaded); use another checkpointing.directory")
    saved = record["draft"]
    mine = registry.config_to_dict(model.spec_config)
    fields = dataclasses.fields(model.spec_config)
    resumable = registry.resumable_keys(type(model.spec_config))
    saved_config = dict(saved["config"])
    if saved["algo"] == mine["algo"]:  # a key added since the checkpoint was written: its default
        saved_config = {**{f.name: f.default for f in fields
                           if f.default is not dataclasses.MISSING}, **saved_config}
    diff = sorted(k for k in set(saved_config) | set(mine["config"])
                  if k not in resumable and saved_config.get(k) != mine["config"].get(k))
    if saved["algo"] != mine["algo"]:
        diff.insert(0, "algo")
    if diff:
        raise checkpoint.CheckpointError(
            f"{path} was trained with another draft: {', '.join(diff)} differ "
            f"(saved draft {saved}); use another checkpointing.directory")


def check_base(path, meta: dict, fingerprint: dict):
    """Refuse a checkpoint trained over another base model, naming what differs."""
    diff = base_fingerprint.differences(meta["training_checkpoint"]["base"], fingerprint)
    if diff:
        raise checkpoint.CheckpointError(
            f"{path} was trained over another base model (saved from model.path "
            f"{meta['training_checkpoint'].get('base_model')!r}): {'; '.join(diff)}; resume "
            f"over the same base and model.dtype, or use another checkpointing.directory")


def check_data(path, meta: dict, fingerprint: dict):
    """Refuse to resume over training data other than the checkpoint's, naming the files
    (a checkpoint saved before data was fingerprinted has nothing to compare)."""
    saved = meta["training_checkpoint"].get("data")
    diff = data_fingerprint.differences(saved, fingerprint) if saved is not None else []
    if diff:
        raise checkpoint.CheckpointError(
            f"{path} was trained on other data: {'; '.join(diff)}; the resumed position "
            f"would point into another stream: restore the files, or train the new data from "
            f"this checkpoint as a new run (model.path=<checkpoint export>, another "
            f"checkpointing.directory)")


def load(path, model, optimizer, fingerprint: dict, data: Optional[dict] = None) -> TrainerState:
    """Restore draft weights, optimizer state and RNG from a verified checkpoint (any
    layout) trained over the base whose `fingerprint` is given, on the data `data`
    (data_fingerprint; None: not checked)."""
    meta = checkpoint.read_meta(path)
    _refuse_objects(path)
    check_compatible(path, meta, model)
    check_base(path, meta, fingerprint)
    if data is not None:
        check_data(path, meta, data)
    record = meta["training_checkpoint"]
    same_world = record["world_size"] == dist.get_world_size()
    template = _sharded_state(model, optimizer, rng_tensors() if same_world else None)
    own_masters = _masters_stored_as_weights(template, path)
    loaded = checkpoint.load_sharded(template, path)
    if own_masters:
        loaded["optimizer"]["fp32_param"].update(checkpoint.load_sharded(own_masters, path))
    if model.draft is not None:
        prefix = f"{model.algo}."
        checkpoint.load_state(model.draft, {k[len(prefix):]: v for k, v in loaded["model"].items()},
                              path)
    optimizer.load(loaded.get("optimizer"), record["adam_step"], record["loss_scale"])
    if same_world:
        set_rng_tensors({k: v[0] for k, v in loaded["rng"].items()})  # this rank's row
    else:
        log.warning("%s was saved by %d ranks, resuming on %d: RNG states start fresh", path,
                    record["world_size"], dist.get_world_size())
    return TrainerState(**record["trainer"])


def _masters_stored_as_weights(template: dict, path) -> dict:
    """The fp32 masters `path` stores as the parameters themselves, taken out of `template`
    and returned as {index: the stored weight read into the master}: a parameter that was
    fp32 when saved was its own master and got no fp32_param entry (a bf16 model's norm
    weights before model_provider gave them the model dtype)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = pickle_guard.dist_metadata(path).state_dict_metadata
    masters = template.get("optimizer", {}).get("fp32_param", {})
    prefix = "optimizer.state.fp32_param."
    own = {}
    for i, t in list(masters.items()):
        key = t.key[len(prefix):]
        weight = stored.get(key)
        if (t.key not in stored and isinstance(weight, TensorStorageMetadata)
                and weight.properties.dtype == torch.float32):
            own[i] = dataclasses.replace(masters.pop(i), key=key)
    return own


# ---- verification and discovery ------------------------------------------------------------
def _file_table(path: Path) -> dict:
    return {str(f.relative_to(path)): {"size": f.stat().st_size, "sha256": data_fingerprint.file_sha256(f)}
            for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST}


def _refuse_objects(path):
    objects = pickle_guard.pickled_objects(pickle_guard.dist_metadata(path))
    if objects:
        raise checkpoint.CheckpointError(
            f"{path} holds pickled objects ({', '.join(objects)}), which a training checkpoint "
            f"never does (loading them could run code); not loaded")


def verify(path) -> None:
    """Raise CheckpointError saying what is wrong with checkpoint `path`, if anything."""
    path = Path(path)
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
        if data_fingerprint.file_sha256(f) != entry["sha256"]:
            raise checkpoint.CheckpointError(f"{path}: file {name} is corrupt (sha256 mismatch)")
    try:  # after the manifest, which names a damaged file by what it should hold
        checkpoint.read_meta(path)
        _refuse_objects(path)
    except FileFormatError as e:
        raise checkpoint.CheckpointError(str(e)) from None


def checkpoints_in(directory, with_manifest: bool = False) -> list:
    """`step_*` checkpoint directories, newest first (not verified)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir()
             and (not with_manifest or (p / MANIFEST).is_file())]
    return sorted(found, key=step_of, reverse=True)


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


def _write_json_atomic(path: Path, obj):
    checkpoint.write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))

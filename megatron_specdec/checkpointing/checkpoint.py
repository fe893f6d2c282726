"""Megatron distributed checkpoints (torch_dist format) that are never half-written.

A checkpoint directory holds the dist_checkpointing files, the tokenizer, and
`specdec_checkpoint.json` (the HF config, layer implementation, draft-module config). It is
written under a temporary name beside its target and committed only when every rank has
finished, so a directory with that name is complete by construction; one without the
metadata file (an interrupted save) is refused. Its pickled files are vetted before any load
(pickle_guard): a checkpoint that would run code is refused without running it.

No pickled objects are written or read. megatron's linear layers put `<module>._extra_state`
in `sharded_state_dict()` as ShardedObjects, which dist_checkpointing pickles on save and
unpickles with `torch.load(weights_only=False)` on load. They hold nothing without fp8 (None
for local layers, an empty tensor for TE without an fp8 recipe), so a save leaves them out (one
holding fp8 metadata is refused by key: fp8 training state is not supported) and a load never
requests them: a Megatron/NeMo checkpoint written with TE loads without its pickles read.

Commit (`commit_dir`): the path is a relative symlink to a hidden versioned sibling
(`.<name>.v-<id>`). A new version is renamed to its final name, a new link to it is made
under a temporary name, and `os.replace` swaps the link in: POSIX rename is atomic, so a
reader of the path sees the old complete checkpoint or the new one, never nothing. The old
version is removed only after the swap, so a reader still inside it then loses it: replacing
a checkpoint while another process loads it is not supported. Unlike swapping directories
(renameat2 RENAME_EXCHANGE) this works on every POSIX filesystem, NFS and Lustre included.
Exports and HF directories are committed as plain directories (`linked=False`): users copy
them to other machines, where a link would dangle. A new one is renamed into place
atomically; one replaced with --overwrite is moved aside first (a brief gap).
"""

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_specdec.checkpointing import pickle_guard
from megatron_specdec.checkpointing import hf_files as files

META_FILE = "specdec_checkpoint.json"
TOKENIZER_DIR = "tokenizer"
FORMAT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


class CheckpointError(RuntimeError):
    pass


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _broadcast(obj):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_output_dir(path, overwrite: bool, what: str = "output directory"):
    """Refuse to replace a non-empty directory unless asked to."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise FileExistsError(f"{what} {path} exists and is not empty; pass --overwrite to replace it")


def write_bytes_atomic(path, data: bytes):
    """`data` into the file `path`: written and synced beside it, then renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path, text: str):
    """`text` (UTF-8) into the file `path`, as write_bytes_atomic."""
    write_bytes_atomic(path, text.encode("utf-8"))


def atomic_dir(path):
    """A fresh temporary directory beside `path` (same filesystem, so rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


@contextlib.contextmanager
def atomic_output(path):
    """`with atomic_output(out_dir) as tmp:` write the directory's files under `tmp`; they
    become the plain directory `out_dir` (exports, HF directories) in one rename when the
    block ends, and nothing is left when it raises."""
    tmp = atomic_dir(path)
    try:
        yield tmp
        commit_dir(tmp, path, linked=False)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def commit_dir(tmp, path, linked: bool = True):
    """Make the complete directory `tmp` the content of `path` with no moment where `path`
    holds neither the old nor the new one (see the module notes); the old one is removed
    after. A real directory at `path` (written before links were used) cannot be replaced
    atomically by a link: it is renamed aside just before the link takes its place.
    `linked=False`: `path` becomes a plain directory (exports, HF directories)."""
    tmp, path = Path(tmp), Path(path)
    tag = uuid.uuid4().hex[:8]
    if not linked:
        version = _own_version(path)
        old = None
        if path.exists() or path.is_symlink():
            old = path.parent / f".{path.name}.old-{tag}"
            os.rename(path, old)
        os.rename(tmp, path)
        if old is not None:
            old.unlink() if old.is_symlink() else shutil.rmtree(old, ignore_errors=True)
        if version is not None:
            shutil.rmtree(version, ignore_errors=True)
        return
    version = path.parent / f".{path.name}.v-{tag}"
    os.rename(tmp, version)
    link = path.parent / f".{path.name}.link-{tag}"
    os.symlink(version.name, link)
    old = _own_version(path)
    if path.is_dir() and not path.is_symlink():
        old = path.parent / f".{path.name}.old-{tag}"
        os.rename(path, old)
    os.replace(link, path)
    if old is not None and old.is_dir():
        shutil.rmtree(old, ignore_errors=True)


def _own_version(path: Path):
    """The versioned sibling a link made by `commit_dir` points to (None for any other link:
    a user's link to another disk is replaced, its target never removed)."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    mine = (target.parent == path.parent.resolve()
            and target.name.startswith(f".{path.name}.v-"))
    return target if mine else None


def remove_dir(path):
    """Remove a committed directory: the link and the version it points to (or a plain
    directory)."""
    path = Path(path)
    if path.is_symlink():
        target = _own_version(path)
        path.unlink()
        if target is not None:
            shutil.rmtree(target, ignore_errors=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def copy_tokenizer(src_dir, dst_dir):
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    files = [f for f in _TOKENIZER_FILES if (src_dir / f).is_file()]
    if not files:
        return
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(src_dir / f, dst_dir / f)


def save_checkpoint(model, path, meta: dict, tokenizer_dir=None, overwrite: bool = False,
                    sharded_state_dict=None):
    """Collectively save `model` (this rank's TP/PP shard) as a complete checkpoint at `path`.

    `meta` must hold at least `hf_config` (a dict); the layout it was saved at is added.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    path = Path(path)
    check_output_dir(path, overwrite, "checkpoint directory")
    tmp = Path(_broadcast(str(atomic_dir(path)) if _rank0() else None))
    try:
        if sharded_state_dict is None:
            sharded_state_dict = model.sharded_state_dict()
        dist_checkpointing.save(_tensors_to_save(sharded_state_dict), str(tmp))
        _barrier()
        if _rank0():
            record = dict(meta)
            record.update(
                format_version=FORMAT_VERSION,
                saved_tensor_parallel=ps.get_tensor_model_parallel_world_size(),
                saved_pipeline_parallel=ps.get_pipeline_model_parallel_world_size(),
            )
            if tokenizer_dir is not None:
                copy_tokenizer(tokenizer_dir, tmp / TOKENIZER_DIR)
            # Written last: its presence marks the dist checkpoint files as complete.
            with open(tmp / META_FILE, "w") as f:
                json.dump(record, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            commit_dir(tmp, path)
    finally:
        _barrier()
        if _rank0() and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_meta(path) -> dict:
    """The metadata of a complete checkpoint; a clear error for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(
            f"{path} is not a complete megatron_specdec checkpoint: {META_FILE} is missing "
            f"(an interrupted save, or not a checkpoint)"
        )
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{path}: dist_checkpointing metadata.json is missing")
    try:
        metadata = pickle_guard.dist_metadata(path)
    except pickle_guard.UnsafeCheckpoint as e:
        raise CheckpointError(str(e)) from None
    files.check_stored_files(path, metadata)
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_file} is corrupt: {e}") from None
    if meta.get("format_version") != FORMAT_VERSION or "hf_config" not in meta:
        raise CheckpointError(
            f"{meta_file}: expected format_version {FORMAT_VERSION} with an hf_config, "
            f"found format_version={meta.get('format_version')!r}"
        )
    return meta


def base_meta_of(meta: dict) -> dict:
    """The metadata of a checkpoint's base half, as a new checkpoint of the same base is saved
    with it: without what a save adds (format, saved layout) or a draft/training record."""
    added = ("format_version", "saved_tensor_parallel", "saved_pipeline_parallel", "draft",
             "training_checkpoint")
    return {k: v for k, v in meta.items() if k not in added}


def hf_config_from_meta(meta: dict):
    from transformers import AutoConfig

    cfg = dict(meta["hf_config"])
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def tensors_only(sharded_state_dict) -> dict:
    """`sharded_state_dict` (nested) without its ShardedObjects: what a load requests, so no
    stored object is unpickled whatever the checkpoint holds."""
    return _split_objects(sharded_state_dict)[1]


def _split_objects(sharded_state_dict):
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    objects, rest = extract_matching_values(sharded_state_dict,
                                            lambda v: isinstance(v, ShardedObject))
    return objects, rest


def _tensors_to_save(sharded_state_dict) -> dict:
    """`sharded_state_dict` without its `_extra_state` objects, refusing any that holds data
    (TE fp8 metadata) or any other object, by key, rather than pickling or dropping it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    objects, rest = _split_objects(sharded_state_dict)
    for obj in nested_values(objects):
        if not obj.key.endswith("_extra_state"):
            raise CheckpointError(
                f"{obj.unique_key}: a ShardedObject (stored as a pickle, which checkpoints of "
                f"this project never hold); store it as tensors or JSON metadata")
        if not _holds_nothing(obj.data):
            raise CheckpointError(
                f"{obj.unique_key} holds data ({type(obj.data).__name__}): Transformer "
                f"Engine fp8 metadata, which would be stored as a pickle; fp8 training state "
                f"is not supported, save without an fp8 recipe")
    return rest


def _holds_nothing(data) -> bool:
    """An `_extra_state` without content: None (local layers), an empty tensor (TE >= 2.0
    without fp8) or a buffer of a saved None (TE < 2.0 without fp8)."""
    import io
    import pickle

    if data is None or (torch.is_tensor(data) and data.numel() == 0):
        return True
    if isinstance(data, io.BytesIO):
        data.seek(0)
        try:
            return torch.load(data, weights_only=True) is None
        except pickle.UnpicklingError:  # fp8 state that is more than plain tensors
            return False
    return False


def load_state(module, state: dict, path):
    """`module.load_state_dict(state)` with its `_extra_state` keys allowed missing (never
    stored) and any other missing or unexpected key an error naming it."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: the checkpoint's tensors do not match the model (missing from the "
            f"checkpoint: {missing}; not in the model: {unexpected})")


def load_sharded(sharded_state_dict, path, validate_access_integrity: bool = True,
                 meta=None) -> dict:
    """dist_checkpointing.load of the tensors of `sharded_state_dict` (no stored object is
    read) from a complete, vetted checkpoint (vetted here unless the caller passes the `meta`
    read_meta returned). `validate_access_integrity=False` where ranks read overlapping whole
    tensors (replicas)."""
    from megatron.core import dist_checkpointing

    if meta is None:
        read_meta(path)
    with files.reading_checkpoint(path):
        return dist_checkpointing.load(tensors_only(sharded_state_dict), str(path),
                                       validate_access_integrity=validate_access_integrity)


def load_checkpoint(model, path, meta=None):
    """Load a complete checkpoint into `model` at the current TP/PP layout (resharding);
    `meta`: see load_sharded."""
    load_state(model, load_sharded(model.sharded_state_dict(), path, meta=meta), path)
    return model


def load_plain_tensors(path, prefix: str = "") -> dict:
    """The tensors of a complete checkpoint whose keys start with `prefix` (prefix stripped),
    as global tensors, in one process, no model built. Only those tensors are read, so a
    draft module is read without the (possibly large) base."""
    from megatron.core import dist_checkpointing

    from megatron_specdec import distributed

    read_meta(path)
    if not dist.is_initialized():
        distributed.initialize(1, 1)  # the torch_dist reader needs a (single-process) group
    wanted = {k: v for k, v in dist_checkpointing.load_tensors_metadata(str(path)).items()
              if k.startswith(prefix)}
    # Every rank reads whole tensors, so shards overlap: skip the access-integrity check.
    with files.reading_checkpoint(path):
        loaded = dist_checkpointing.load(wanted, str(path), validate_access_integrity=False)
    return {k[len(prefix):]: v for k, v in loaded.items() if torch.is_tensor(v)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}; expected float32, bfloat16 or float16") from None

"""Refuse a dist checkpoint that would run code when loaded, without running it.

torch's dist-checkpoint reader unpickles `.metadata` with plain `pickle.load`, megatron-core
unpickles a ShardedObject (a bytes entry of that metadata) with `torch.load(weights_only=
False)`, and `common.pt` is a torch pickle: a crafted checkpoint can execute anything. Here
`.metadata` is unpickled with an allow-list of the plain data classes torch writes there (any
other global stops the unpickler before it is imported or called), `common.pt` must load
under torch's weights-only unpickler, and `pickled_objects` names the bytes entries, which
callers that never write any (training checkpoints) refuse.
"""

import pickle
import re
from pathlib import Path

import torch

METADATA = ".metadata"
COMMON = "common.pt"

_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    f"{_DCP}.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                         "StorageMeta", "_MEM_FORMAT_ENCODING"},
    f"{_DCP}.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    f"{_DCP}.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath"},  # StorageMeta.checkpoint_id of a plain torch save
}


class UnsafeCheckpoint(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module, name):
        allowed = name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise UnsafeCheckpoint(
                f"{self.source}: its pickle refers to {module}.{name}, which torch never writes "
                f"there (loading it could run code); not loaded")
        return super().find_class(module, name)


def dist_metadata(path):
    """The torch dist-checkpoint Metadata of checkpoint `path`, unpickled without running
    code; UnsafeCheckpoint when `.metadata` or `common.pt` holds anything else."""
    path = Path(path)
    source = path / METADATA
    try:
        with open(source, "rb") as f:
            metadata = _MetadataUnpickler(f, source).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise UnsafeCheckpoint(
            f"{source} is not a torch dist-checkpoint metadata pickle: {e}") from None
    common = path / COMMON
    if common.is_file():
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            reason = (f"it refers to {found.group(1)}" if found
                      else "torch's weights-only loader refused it")
            raise UnsafeCheckpoint(
                f"{common} holds more than tensors and plain values (loading it could run "
                f"code: {reason}); not loaded") from None
    return metadata


def pickled_objects(metadata) -> list:
    """Keys of the entries megatron-core would unpickle with weights_only=False."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return sorted(k for k, v in metadata.state_dict_metadata.items()
                  if isinstance(v, BytesStorageMetadata))

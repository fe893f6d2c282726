"""Weights read and written one tensor at a time, so conversion never holds a second copy of
a model: an HF safetensors directory read lazily, a dist checkpoint read one tensor (or one
layer of a stacked one) per call, and safetensors files (sharded under a size limit, with an
index) written from a stream whose headers are known first. A file that cannot be read as what
it should be raises FileFormatError naming it, never the reader library's bare error.
"""

import contextlib
import itertools
import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"

# torch dtype <-> the safetensors format's dtype names
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL",
              torch.uint8: "U8", torch.int8: "I8"}
_LAYERS = "decoder.layers."


class FileFormatError(ValueError):
    """A file that is there but is not what it should be: truncated or foreign safetensors,
    JSON that does not parse, an index or checkpoint naming files that are absent or short.
    The message names the file."""


def read_json(path) -> dict:
    """A JSON file's content; FileFormatError naming the file when it does not parse."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FileFormatError(f"{path}: not valid JSON ({e})") from None


@contextlib.contextmanager
def open_safetensors(path):
    """safe_open of `path`, its errors (a truncated file, a foreign one) as FileFormatError
    naming the file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise FileFormatError(f"{path}: not a readable safetensors file, truncated or corrupt "
                              f"({e})") from None


def hf_weight_files(hf_dir) -> dict:
    """{tensor name: file path} of an HF directory (one file, or sharded with an index); every
    file the index names must be there."""
    hf_dir = Path(hf_dir)
    index = hf_dir / HF_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise FileFormatError(f"{index}: expected a non-empty \"weight_map\" of tensor names "
                                  f"to files")
        absent = sorted({f for f in weight_map.values() if not (hf_dir / str(f)).is_file()})
        if absent:
            raise FileFormatError(f"{index} names {', '.join(absent)}, not in {hf_dir}")
        return {k: hf_dir / f for k, f in weight_map.items()}
    if not (hf_dir / HF_WEIGHTS).is_file():
        raise FileNotFoundError(f"no {HF_WEIGHTS} or {HF_INDEX} in {hf_dir}")
    with open_safetensors(hf_dir / HF_WEIGHTS) as f:
        return {k: hf_dir / HF_WEIGHTS for k in f.keys()}


def check_stored_files(ckpt_dir, metadata) -> None:
    """Every file a dist checkpoint's `metadata` (torch's Metadata) stores tensor bytes in is
    there and long enough: a missing or truncated `.distcp` named before any read."""
    needed = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        path = Path(ckpt_dir) / name
        if not path.is_file():
            raise FileFormatError(f"{path} is missing: the checkpoint's .metadata stores "
                                  f"tensors in it")
        size = path.stat().st_size
        if size < end:
            raise FileFormatError(f"{path} is truncated: {size} bytes, the checkpoint's "
                                  f".metadata stores tensors up to byte {end}")


class HFTensors(Mapping):
    """The tensors of an HF directory by name, each read from its file when asked for (and
    cast to `dtype` if floating): nothing is held between reads. The file is opened per read,
    so no mapping of it outlives the tensor. `read` reads part of a tensor (a TP rank's)."""

    def __init__(self, hf_dir, dtype=None):
        self._files = hf_weight_files(hf_dir)
        self._dtype = dtype

    def __getitem__(self, name):
        return self.read(name)

    def read(self, name, dim=None, start=0, stop=None):
        """The tensor, or its rows (dim 0) or columns (dim 1) [start, stop): only those
        bytes are read (safetensors slices)."""
        with open_safetensors(self._files[name]) as f:
            if dim is None:
                tensor = f.get_tensor(name)
            else:
                part = f.get_slice(name)
                tensor = part[start:stop] if dim == 0 else part[:, start:stop]
        if self._dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self._dtype)
        return tensor

    def shape(self, name) -> tuple:
        with open_safetensors(self._files[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def __contains__(self, name):  # Mapping's would read the tensor
        return name in self._files

    def __iter__(self):
        return iter(self._files)

    def __len__(self):
        return len(self._files)

    def shapes(self) -> dict:
        """{name: shape} from the file headers, no tensor read."""
        shapes = {}
        for path in sorted(set(self._files.values())):
            with open_safetensors(path) as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        return shapes


class CheckpointTensors(Mapping):
    """Global tensors of a dist checkpoint (any saved TP/PP layout) by name, each read when
    asked for: `load` reads only the stored chunks that overlap the tensors (or layers) asked
    for, `meta` reads nothing. Per-layer names (`decoder.layers.{i}.x`) address the layers the
    checkpoint stores stacked as `decoder.layers.x`. With `prefix`, only keys under it, named
    without it (a draft module's `eagle3.`). Read with torch.distributed.checkpoint directly
    (no process group): megatron's loader cannot read part of a stacked tensor in a
    one-process world."""

    def __init__(self, ckpt_dir, prefix: str = ""):
        from torch.distributed.checkpoint import FileSystemReader

        from megatron_specdec.checkpointing import checkpoint

        checkpoint.read_meta(ckpt_dir)  # complete, and its pickled metadata vetted
        self._dir, self._prefix = str(ckpt_dir), prefix
        self._stored = {k[len(prefix):]: md for k, md in
                        FileSystemReader(self._dir).read_metadata().state_dict_metadata.items()
                        if hasattr(md, "chunks") and k.startswith(prefix)}  # tensors only

    def _stored_name(self, name):
        """(stored key without the prefix, layer index or None) of a per-layer name."""
        if name.startswith(_LAYERS):
            layer, rest = name[len(_LAYERS):].split(".", 1)
            return _LAYERS + rest, int(layer)
        return name, None

    def __contains__(self, name):
        key, layer = self._stored_name(name)
        return key in self._stored and (layer is None or layer < self._stored[key].size[0])

    def __iter__(self):
        for key, md in self._stored.items():
            if key.startswith(_LAYERS):
                yield from (f"{_LAYERS}{i}.{key[len(_LAYERS):]}" for i in range(md.size[0]))
            else:
                yield key

    def __len__(self):
        return sum(1 for _ in self)

    def __getitem__(self, name):
        return self.load([name])[name]

    def meta(self, name) -> torch.Tensor:
        """A meta-device tensor with the stored shape and dtype (nothing read)."""
        key, layer = self._stored_name(name)
        md = self._stored[key]
        return torch.empty(md.size if layer is None else md.size[1:],
                           dtype=md.properties.dtype, device="meta")

    def load(self, names) -> dict:
        """{name: global tensor} of `names`, in one read."""
        from torch.distributed.checkpoint import FileSystemReader, load

        regions = {}
        for name in names:
            if name not in self:
                raise KeyError(f"{self._dir}: no tensor {self._prefix + name!r} in the checkpoint")
            key, layer = self._stored_name(name)
            meta = self.meta(name)
            buf = torch.empty((1,) * (layer is not None) + tuple(meta.shape), dtype=meta.dtype)
            offsets = (layer or 0,) * (layer is not None) + (0,) * meta.dim()
            regions[name] = (self._prefix + key, offsets, buf)
        with reading_checkpoint(self._dir):
            load({}, storage_reader=FileSystemReader(self._dir), planner=_RegionPlanner(regions),
                 no_dist=True)
        return {name: buf[0] if self._stored_name(name)[1] is not None else buf
                for name, (_, _, buf) in regions.items()}


@contextlib.contextmanager
def reading_checkpoint(ckpt_dir):
    """A failed read of a dist checkpoint's tensors (torch's CheckpointException, a multi-line
    report of every rank's traceback) as FileFormatError naming the checkpoint."""
    try:
        yield
    except CheckpointException as e:
        failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        reason = (str(failures[0]) if failures else "").strip() or type(e).__name__
        reason = reason.splitlines()[0].split(". ")[0]  # the first sentence of the first rank's
        raise FileFormatError(f"{ckpt_dir}: its stored tensors could not be read, a corrupt "
                              f"file? ({reason})") from None


class _RegionPlanner(DefaultLoadPlanner):
    """Reads regions {name: (stored key, global offsets, buffer)} of stored tensors."""

    def __init__(self, regions):
        super().__init__()
        self._regions = regions
        self._targets = {(key, tuple(offsets)): buf for key, offsets, buf in regions.values()}

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items = []
        for key, offsets, buf in self._regions.values():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=buf.shape)
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        index = read_item.dest_index
        return self.transform_tensor(read_item, self._targets[(index.fqn, tuple(index.offset))])


def _nbytes(shape, dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def write_safetensors(path, specs, tensors, metadata=None):
    """Write a safetensors file from `tensors`, an iterable of (name, tensor) produced one at a
    time in the order of `specs` [(name, shape, dtype)], which fixes the header first; a
    tensor that differs from its spec is an error naming it."""
    header, offset = {}, 0
    for name, shape, dtype in specs:
        size = _nbytes(shape, dtype)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    tensors, written = iter(tensors), 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in specs:
            # Unpacked by hand: zip would keep the last pair alive while the next is read.
            got, tensor = next(tensors, (None, None))
            if tensor is None:
                break
            if got != name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{path}: tensor {got!r} {tuple(tensor.shape)} {tensor.dtype} "
                                 f"does not match the header's {name!r} {tuple(shape)} {dtype}")
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            written += 1
            del tensor  # not alive while the next one is read
    if written != len(specs):
        raise ValueError(f"{path}: {written} tensors written, the header lists {len(specs)}")


def write_sharded(directory, specs, tensors, max_shard_bytes=None, weights_name=HF_WEIGHTS,
                  index=False, metadata=None):
    """Write the stream `tensors` ((name, tensor) in the order of `specs` [(name, shape,
    dtype)]) into `directory`, one tensor at a time: one file `weights_name` when the total
    fits `max_shard_bytes` (None: no limit), else `model-0000i-of-0000n.safetensors` files of
    at most that size each (a larger tensor gets a file to itself), in `specs` order, and the
    index (HF_INDEX) HF readers and the engines follow; `index`: write it for one file too."""
    directory = Path(directory)
    sizes = [_nbytes(shape, dtype) for _, shape, dtype in specs]
    shards, current, filled = [], [], 0
    for spec, size in zip(specs, sizes):
        if max_shard_bytes is not None and current and filled + size > max_shard_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(spec)
        filled += size
    shards.append(current)
    names = ([weights_name] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    stream = iter(tensors)
    for shard, name in zip(shards, names):
        write_safetensors(directory / name, shard, itertools.islice(stream, len(shard)), metadata)
    extra = next(stream, None)
    if extra is not None:
        raise ValueError(f"{directory}: tensor {extra[0]!r} is not in the header")
    if len(shards) > 1 or index:
        weight_map = {spec[0]: name for shard, name in zip(shards, names) for spec in shard}
        record = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (directory / HF_INDEX).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")

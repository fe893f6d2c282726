"""Machinery that applies a declarative HF <-> Megatron weight table.

A table is a list of `Rule`s. Each names a Megatron tensor (global layer index `{i}`), the HF
tensor(s) it comes from, how they merge (`copy`, `qkv`, `gate_up`, `vocab`) and the tensor
parallel split dimension. Layouts follow Megatron-Bridge: QKV interleaved per query group
`[q heads of group g, k_g, v_g]`, fc1 = `[gate; up]`, vocabulary padded for TP. An `experts`
rule covers the routed experts of a mixture-of-experts layer: its HF names hold `{e}`, and the
Megatron tensor is the one megatron's SequentialMLP checkpoints, the experts stacked on a
leading global expert axis, so expert parallel layouts reshard like any other axis.
"""

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: Tuple[str, ...]
    kind: str = "copy"  # copy | qkv | heads_in | gate_up | vocab
    tp_dim: Optional[int] = None  # None: replicated across TP
    optional: bool = False  # present only in some families (biases, q/k norms)
    experts: bool = False  # one HF group per routed expert `{e}`, stacked on a leading axis


@dataclass(frozen=True)
class Geometry:
    """Shapes the merge/split rules need."""

    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    padded_groups: int  # zero groups appended so TP divides them
    num_experts: int = 0  # routed experts per MoE layer (0: dense)

    @classmethod
    def from_hf(cls, hf_config, padding: dict):
        from megatron_specdec.models.families import head_dim, query_groups

        return cls(
            num_heads=hf_config.num_attention_heads,
            num_groups=query_groups(hf_config),
            head_dim=head_dim(hf_config),
            vocab_size=hf_config.vocab_size,
            padded_vocab_size=padding["vocab_size"],
            padded_groups=padding["query_groups"],
            num_experts=getattr(hf_config, "num_experts", None)
            or getattr(hf_config, "num_local_experts", None) or 0,
        )

    @property
    def heads_per_group(self):
        return self.num_heads // self.num_groups


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows, *t.shape[1:])]) if rows else t


class WeightMappingError(KeyError):
    def __str__(self):
        return str(self.args[0])


def check_shapes(expected: dict, found: dict, source):
    """Every tensor named in `expected` ({name: shape}) is in `found` ({name: shape}) with that
    shape; the error names the tensor, `source` (a file or directory), expected and found."""
    for name, shape in expected.items():
        if name not in found:
            raise WeightMappingError(
                f"tensor {name!r} is missing from {source} (expected shape {shape})")
        if tuple(found[name]) != tuple(shape):
            raise WeightMappingError(
                f"tensor {name!r} in {source}: expected shape {tuple(shape)}, "
                f"found {tuple(found[name])}")


def _expand(template: str, layer: Optional[int], expert: Optional[int] = None) -> str:
    return template.format(i=layer, e=expert) if layer is not None else template


def expand_rules(rules, num_layers: int, num_experts: int = 0):
    """Yield (rule, layer_index or None, megatron_name, hf_names) for every concrete tensor;
    an experts rule's hf_names are its HF templates for expert 0, then for expert 1, ..."""
    for rule in rules:
        layers = range(num_layers) if "{i}" in rule.megatron else [None]
        for layer in layers:
            if rule.experts:
                hf = tuple(_expand(h, layer, e) for e in range(num_experts) for h in rule.hf)
            else:
                hf = tuple(_expand(h, layer) for h in rule.hf)
            yield rule, layer, _expand(rule.megatron, layer), hf


def per_expert(rule: Rule) -> Rule:
    """The rule of one expert's slice of an experts rule's tensor."""
    return replace(rule, experts=False)


def expert_sources(rule: Rule, hf_names, expert: int):
    """The HF names (or tensors) of one expert among an experts rule's expanded sources."""
    k = len(rule.hf)
    return hf_names[expert * k:(expert + 1) * k]


def merge(rule: Rule, tensors, geo: Geometry) -> torch.Tensor:
    """HF tensor(s) -> one global Megatron tensor."""
    if rule.experts:
        return torch.stack([merge(per_expert(rule), expert_sources(rule, tensors, e), geo)
                            for e in range(len(tensors) // len(rule.hf))])
    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "vocab":
        return _pad_rows(tensors[0], geo.padded_vocab_size - tensors[0].shape[0])
    if rule.kind == "gate_up":
        return torch.cat(tensors, dim=0)
    if rule.kind == "qkv":
        return _group_qkv(*tensors, geo.num_groups, geo.padded_groups, geo)
    if rule.kind == "heads_in":
        extra = (geo.padded_groups - geo.num_groups) * geo.heads_per_group * geo.head_dim
        return _pad_cols(tensors[0], extra)
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    return _pad_rows(t.t(), cols).t()


def _group_qkv(q, k, v, groups: int, padded: int, geo: Geometry) -> torch.Tensor:
    """q/k/v rows of `groups` query groups -> `[q heads of group g, k_g, v_g]` per group,
    then zero groups up to `padded`."""
    rest = q.shape[1:]
    q = q.reshape(groups, geo.heads_per_group * geo.head_dim, *rest)
    k = k.reshape(groups, geo.head_dim, *rest)
    v = v.reshape(groups, geo.head_dim, *rest)
    return _pad_rows(torch.cat([q, k, v], dim=1), padded - groups).reshape(-1, *rest)


def _chunk_range(n: int, tp_rank: int, tp_size: int) -> Tuple[int, int]:
    """[start, stop) of `chunk(tp_size)[tp_rank]` along a dimension of size n."""
    size = -(-n // tp_size)
    return min(tp_rank * size, n), min((tp_rank + 1) * size, n)


def split(rule: Rule, tensor: torch.Tensor, geo: Geometry):
    """One global Megatron tensor -> the HF tensor(s) it holds (inverse of `merge`)."""
    if rule.experts:
        return tuple(itertools.chain.from_iterable(split(per_expert(rule), t, geo) for t in tensor))
    if rule.kind == "copy":
        return (tensor,)
    if rule.kind == "vocab":
        return (tensor[: geo.vocab_size],)
    if rule.kind == "gate_up":
        return tuple(tensor.chunk(2, dim=0))
    if rule.kind == "qkv":
        per_group = geo.heads_per_group
        rest = tensor.shape[1:]
        grouped = tensor.reshape(-1, (per_group + 2) * geo.head_dim, *rest)[: geo.num_groups]
        q, k, v = grouped.split([per_group * geo.head_dim, geo.head_dim, geo.head_dim], dim=1)
        return tuple(t.reshape(-1, *rest) for t in (q, k, v))
    if rule.kind == "heads_in":
        return (tensor[:, : geo.num_heads * geo.head_dim],)
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def shard(rule: Rule, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a global tensor (fc1 splits gate and up separately)."""
    if rule.tp_dim is None or tp_size == 1:
        return tensor
    if rule.kind == "gate_up":
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    return tensor.chunk(tp_size, dim=rule.tp_dim)[tp_rank]


def unshard(rule: Rule, pieces) -> torch.Tensor:
    """Inverse of `shard`: the TP slices of all ranks, in rank order -> the global tensor."""
    if rule.tp_dim is None or len(pieces) == 1:
        return pieces[0]
    if rule.kind == "gate_up":
        halves = [p.chunk(2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(pieces, dim=rule.tp_dim)


class MergedTensors(Mapping):
    """Global Megatron tensors by name, each merged from `hf_state` when asked for: with a lazy
    `hf_state` (files.HFTensors) a consumer that takes them one by one holds one at a time.
    Every source tensor is checked present up front, before anything is read."""

    def __init__(self, rules, hf_state, geo: Geometry, num_layers: int):
        self._hf, self._geo, self._sources = hf_state, geo, {}
        for rule, _, meg_name, hf_names in expand_rules(rules, num_layers, geo.num_experts):
            present = [n in hf_state for n in hf_names]
            if not all(present):
                if rule.optional and not any(present):
                    continue
                missing = [n for n, p in zip(hf_names, present) if not p]
                raise WeightMappingError(f"missing tensor {missing[0]!r} (needed for {meg_name})")
            self._sources[meg_name] = (rule, hf_names)

    def __getitem__(self, meg_name):
        rule, hf_names = self._sources[meg_name]
        return merge(rule, [self._hf[n] for n in hf_names], self._geo)

    def _read(self, name, dim, start, stop):
        """Rows (dim 0) or columns (dim 1) [start, stop) of a source tensor: from its file
        alone when the source can read slices (files.HFTensors), else a view."""
        if hasattr(self._hf, "read"):
            return self._hf.read(name, dim, start, stop)
        return self._hf[name].narrow(dim, start, stop - start)

    def _size(self, name, dim) -> int:
        return (self._hf.shape(name) if hasattr(self._hf, "shape") else self._hf[name].shape)[dim]

    def shard(self, meg_name, tp_rank: int, tp_size: int, expert: Optional[int] = None):
        """`shard(rule, self[meg_name], tp_rank, tp_size)`, read as the slices of its sources
        this rank owns: a rank never reads, nor holds, another rank's part. `expert`: of an
        experts rule, that expert's slice only (an expert parallel rank reads its experts)."""
        rule, hf_names = self._sources[meg_name]
        if expert is not None:
            rule, hf_names = per_expert(rule), expert_sources(rule, hf_names, expert)
            if rule.tp_dim is None or tp_size == 1:
                return merge(rule, [self._hf[n] for n in hf_names], self._geo)
        if rule.tp_dim is None or tp_size == 1:
            return self[meg_name]
        geo = self._geo
        if rule.kind in ("qkv", "heads_in"):  # whole query groups, padding groups last
            per_rank = geo.padded_groups // tp_size
            first = tp_rank * per_rank
            real = max(0, min(first + per_rank, geo.num_groups) - first)
            width = geo.heads_per_group * geo.head_dim
            if rule.kind == "heads_in":
                cols = self._read(hf_names[0], 1, first * width, (first + real) * width)
                return _pad_cols(cols, (per_rank - real) * width)
            rows = [self._read(name, 0, first * w, (first + real) * w)
                    for name, w in zip(hf_names, (width, geo.head_dim, geo.head_dim))]
            return _group_qkv(*rows, real, per_rank, geo)
        if rule.kind == "vocab":  # rows of the padded vocabulary, padding rows zero
            start, stop = _chunk_range(geo.padded_vocab_size, tp_rank, tp_size)
            rows = self._read(hf_names[0], 0, min(start, geo.vocab_size), min(stop, geo.vocab_size))
            return _pad_rows(rows, stop - start - rows.shape[0])
        if rule.kind == "gate_up":  # this rank's rows of gate, then of up
            start, stop = _chunk_range(self._size(hf_names[0], 0), tp_rank, tp_size)
            return torch.cat([self._read(name, 0, start, stop) for name in hf_names])
        if rule.kind == "copy":
            start, stop = _chunk_range(self._size(hf_names[0], rule.tp_dim), tp_rank, tp_size)
            return self._read(hf_names[0], rule.tp_dim, start, stop)
        raise ValueError(f"unknown rule kind {rule.kind!r}")

    def __iter__(self):
        return iter(self._sources)

    def __len__(self):
        return len(self._sources)


def hf_to_megatron(rules, hf_state, geo: Geometry, num_layers: int) -> dict:
    """HF state dict -> global Megatron tensors (global layer indices, padded vocabulary)."""
    return dict(MergedTensors(rules, hf_state, geo, num_layers))


def split_tensors(rules, meg_state, geo: Geometry, num_layers: int, layers=None):
    """(HF name, tensor) pairs of the global Megatron tensors in `meg_state` (inverse of the
    merge), one rule at a time; `layers`: only rules of those layer indices (None in it: the
    non-layer rules), all when not given."""
    for rule, at, meg_name, hf_names in expand_rules(rules, num_layers, geo.num_experts):
        if layers is not None and at not in layers:
            continue
        if meg_name not in meg_state:
            if rule.optional:
                continue
            raise WeightMappingError(f"missing tensor {meg_name!r} in the Megatron checkpoint")
        yield from zip(hf_names, split(rule, meg_state[meg_name], geo))


class _Metas(Mapping):
    """The meta tensors (shape and dtype, nothing read) of a source with `meta(name)`."""

    def __init__(self, source):
        self._source = source

    def __getitem__(self, name):
        return self._source.meta(name)

    def __contains__(self, name):
        return name in self._source

    def __iter__(self):
        return iter(self._source)

    def __len__(self):
        return len(self._source)


def split_stream(rules, source, geo: Geometry, num_layers: int, groups=(None,), dtype=None):
    """(specs [(HF name, shape, dtype)], stream of (HF name, tensor)) of the global Megatron
    tensors in `source`, a Mapping that reads one tensor per item and tells its shape and
    dtype by `meta(name)` (files.CheckpointTensors): the specs come first, from the metadata
    alone, and the stream reads one Megatron tensor at a time, so a writer holds one tensor
    and its HF pieces. `groups`: the `layers` of `split_tensors`, in write order (None: all);
    `dtype`: floating tensors cast to it (None: as stored)."""
    def cast(t):
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    def pieces(state):
        return itertools.chain.from_iterable(
            split_tensors(rules, state, geo, num_layers, layers) for layers in groups)

    specs = [(name, tuple(t.shape), cast(t).dtype) for name, t in pieces(_Metas(source))]
    # starmap keeps no reference to a piece once handed out (a generator's loop variable would)
    return specs, itertools.starmap(lambda name, t: (name, cast(t)), pieces(source))


def megatron_to_hf(rules, meg_state: dict, geo: Geometry, num_layers: int) -> dict:
    """Global Megatron tensors -> HF state dict (inverse of `hf_to_megatron`)."""
    return dict(split_tensors(rules, meg_state, geo, num_layers))


_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
# SequentialMLP's parameter of local expert j; checkpointed as `...experts.experts.<rest>`.
_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)\.(.*)$")


def to_global_name(local_name: str, layer_offset: int, keys_map: dict) -> str:
    """A module's parameter name -> its checkpoint name: global layer index (a stage whose
    first layer is global 12 holds `decoder.layers.3.x` as 15) and the layer spec's
    `sharded_state_dict_keys_map` applied, as dist_checkpointing does."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    rest = m[3][1:]
    for old, new in keys_map.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
            break
    return f"{m[1]}{int(m[2]) + layer_offset}.{rest}"


def layer_keys_map(model) -> dict:
    decoder = getattr(model, "decoder", None)
    if decoder is None or not len(decoder.layers):
        return {}
    return dict(decoder.layers[0].submodules_config.sharded_state_dict_keys_map)


def rule_index(rules, num_layers: int) -> dict:
    return {meg: rule for rule, _, meg, _ in expand_rules(rules, num_layers)}


def load_into_model(model, rules, global_state, num_layers: int, layer_offset: int,
                    tp_rank: int, tp_size: int, experts=(0, 0, 1), kept=()):
    """Copy this rank's slices of `global_state` (a dict, or MergedTensors to read only this
    rank's slices, one tensor at a time) into `model`'s parameters, checking shapes.
    `experts`: (global index of this rank's first expert, expert TP rank, expert TP size);
    `kept`: names of buffers the model sets itself (no HF tensor holds them)."""
    index = rule_index(rules, num_layers)
    keys_map = layer_keys_map(model)
    first_expert, etp_rank, etp_size = experts
    params = {k: v for k, v in model.state_dict().items()
              if not k.endswith("_extra_state") and k not in kept}
    for local_name, param in params.items():
        name = to_global_name(local_name, layer_offset, keys_map)
        expert, rank, size = None, tp_rank, tp_size
        m = _LOCAL_EXPERT.match(name)
        if m:
            name, expert = f"{m[1]}experts.{m[3]}", first_expert + int(m[2])
            rank, size = etp_rank, etp_size
        if name not in global_state:
            raise WeightMappingError(f"no source tensor for model parameter {name!r}")
        if isinstance(global_state, MergedTensors):
            value = global_state.shard(name, rank, size, expert)
        elif expert is not None:
            value = shard(per_expert(index[name]), global_state[name][expert], rank, size)
        else:
            value = shard(index[name], global_state[name], rank, size)
        if tuple(value.shape) != tuple(param.shape):
            where = f"TP rank {rank}" if expert is None else f"expert {expert}, expert TP rank {rank}"
            raise WeightMappingError(
                f"tensor {name!r}: expected shape {tuple(param.shape)} on {where}, "
                f"found {tuple(value.shape)}"
            )
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        del value  # not alive while the next tensor is read

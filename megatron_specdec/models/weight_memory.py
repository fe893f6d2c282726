"""Decoding weights in one buffer on transparent huge pages.

A batch-1 decode step streams every weight once; on 4 KiB pages that stream takes a TLB
miss every 4 KiB and restarts the hardware prefetcher at each page. Where the kernel grants
2 MiB pages to memory that asks for them (Linux, THP `madvise` or `always`), a step of the
embedded SmolLM2 ran 7-8% faster with its weights there (Intel Xeon with AMX, 2 cores,
bench/bench_decode_step.py), and a plain read of 256 MiB ran ~15% faster.
`read_bandwidth_gbs` measures on such memory too, so the bound the benches quote is the
one the weights can reach.

A float32 weight whose values are all bfloat16 (or float16) values, as a model trained in
bf16 and imported in float32 (most Hugging Face checkpoints) or a draft from a bf16 export
holds, also gets a 16-bit copy there (`narrow_copy`): the skinny GEMM widens it exactly as it
reads it, so a decoding product streams half the bytes and computes the same bits.

A run of decoding layers may read its products' weights repacked as panels (`panel_copy`, the
skinny op's schedule 3): a second copy of what it streams, made where a run's measured choice
takes the panels, and the same bits.
"""

import logging
import mmap
import time
import weakref
from functools import lru_cache
from typing import Optional

import torch

from megatron_specdec.acceptance.ops import op_available
from megatron_specdec.models import first_use

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20

# id -> weak reference of each parameter already in a huge-page buffer (a speculative
# model's base is placed with it); keyed by id, as tensors compare elementwise.
_placed = {}


def _is_placed(p) -> bool:
    ref = _placed.get(id(p))
    return ref is not None and ref() is p


def huge_page_empty(numel: int, dtype=torch.float32) -> torch.Tensor:
    """An uninitialised 1-D tensor of `numel` elements at a 2 MiB boundary of an anonymous
    mapping advised for huge pages (plain pages where the kernel has no THP or refuses)."""
    size = max(1, numel) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(region)
    address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    start = (-address) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # no THP in this kernel: plain pages
            log.debug("madvise(MADV_HUGEPAGE) refused (%s): plain pages", exc)
    # frombuffer keeps `view` (and through it the mapping) alive as long as the tensor.
    return torch.frombuffer(view[start:start + size], dtype=dtype)[:numel]


def place_weights(module: torch.nn.Module):
    """Move the float parameters of `module` that own their storage (not views into a
    training buffer) into one huge-page buffer, in module order, so that a decode step
    streams them as one region; values and Parameter objects unchanged, each parameter moved
    once."""
    params = [p for p in module.parameters()
              if not _is_placed(p) and p.dtype.is_floating_point and p.device.type == "cpu"
              and p.is_contiguous()
              and p.untyped_storage().nbytes() == p.numel() * p.element_size()]
    if not params:
        return
    by_dtype = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    started = time.perf_counter()
    for dtype, group in by_dtype.items():
        buffer = huge_page_empty(sum(p.numel() for p in group), dtype)
        offset = 0
        with torch.no_grad():
            for p in group:
                view = buffer[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                offset += p.numel()
                _placed[id(p)] = weakref.ref(p)
    log.debug("placed %d parameters of %s on huge pages in %.2f s", len(params),
              type(module).__name__, time.perf_counter() - started)


# id -> (weak reference, (data pointer, version), copy or None) of each weight asked for a
# narrow copy, and for a panel copy (_per_weight).
_narrow = {}
_panels = {}
# The copies whose memory warning was given (once each).
_warned_memory = set()


def available_bytes() -> Optional[int]:
    """The memory the system can still give (Linux MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _room_for(nbytes: int, missing: str, fallback: str) -> bool:
    """Whether a copy of nbytes leaves at least as much available memory again (a float32
    8B base on a CPU would otherwise grow by half); where it does not, warns once per kind of
    copy that `missing` is not made and what is read instead (`fallback`)."""
    available = available_bytes()
    if available is None or 2 * nbytes <= available:
        return True
    if fallback not in _warned_memory:
        _warned_memory.add(fallback)
        log.warning("%s (%.0f MB, %.0f MB of memory available): %s", missing, nbytes / 1e6,
                    available / 1e6, fallback)
    return False


def _per_weight(table: dict, weight: torch.Tensor, make):
    """make(weight), made once per weight and kept in `table` until the weight's storage or
    values change (placement, a training step) or it is freed; keyed by id, as tensors compare
    elementwise (the decoding layers ask ~120 times a SmolLM2 step)."""
    found = table.get(id(weight))
    key = (weight.data_ptr(), weight._version)
    if found is not None and found[0]() is weight and found[1] == key:
        return found[2]
    made = make(weight)
    first_use.note()
    number = id(weight)
    table[number] = (weakref.ref(weight, lambda _: table.pop(number, None)), key, made)
    return made


def narrow_copy(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """A bfloat16, else float16, copy of the float32 CPU matrix `weight` on huge pages when
    each of its values is exactly a value of that type and the memory has room (None
    otherwise). Checked once per weight, and again after its storage or values change."""
    return _per_weight(_narrow, weight, _narrowed)


def _narrowed(weight: torch.Tensor) -> Optional[torch.Tensor]:
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    copy = None
    with torch.no_grad():
        head = weight.reshape(-1)[:4096]
        for dtype in (torch.bfloat16, torch.float16):
            if not torch.equal(head.to(dtype).float(), head):
                continue  # a weight of float32 values shows it in its first ones
            if not _room_for(weight.numel() * dtype.itemsize,
                             f"no 16-bit copy of a {list(weight.shape)} weight",
                             "such weights are read in float32"):
                break  # checked before the conversion, which needs that memory too
            narrow = weight.to(dtype)
            if torch.equal(narrow.float(), weight):
                copy = huge_page_empty(weight.numel(), dtype).view(weight.shape)
                copy.copy_(narrow)
                break
    return copy


def streamed(weight: torch.Tensor) -> torch.Tensor:
    """The weight a skinny decoding product reads: its 16-bit copy where it has one (half the
    bytes, the same bits), else the weight. Looked up per call: the copy follows the weight's
    values."""
    narrow = narrow_copy(weight)
    return weight if narrow is None else narrow



@lru_cache(maxsize=None)
def panel_width() -> int:
    """Outputs of a packed panel on this process's path of the skinny op; 0: no panels here."""
    return torch.ops.megatron_specdec.skinny_panel_width() if op_available("skinny_pack") else 0


def panels_take(weight: torch.Tensor) -> bool:
    """Whether `weight`'s shape takes panels: out-features a multiple of panel_width(),
    in-features of 16."""
    width = panel_width()
    return (width > 0 and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.shape[0] % width == 0 and weight.shape[1] % 16 == 0)


def room_for_panels(weights) -> bool:
    """Whether panel copies of all of `weights` leave as much memory available again (checked
    before any is made; warns once where not)."""
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return _room_for(nbytes, f"no panel copies of a run's {len(weights)} product weights",
                     "the run reads its weights as stored")


def panel_copy(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight` (a decoding product's weight as `streamed` gives it) repacked as the skinny op's
    panels on huge pages, or None where its shape takes none (panels_take). Made once per
    weight, and again after its storage or values change; the caller checks the memory first
    (room_for_panels)."""
    return _per_weight(_panels, weight, _packed)


def _packed(weight: torch.Tensor) -> Optional[torch.Tensor]:
    if not panels_take(weight):
        return None
    copy = huge_page_empty(weight.numel(), weight.dtype).view(weight.shape)
    with torch.no_grad():
        copy.copy_(torch.ops.megatron_specdec.skinny_pack(weight))
    return copy


def drop_panel_copies(weights):
    """Free the panel copies of `weights` (a run whose measured choice did not take them)."""
    for weight in weights:
        _panels.pop(id(weight), None)

"""Decoding weights in one buffer on transparent huge pages.

A batch-1 decode step streams every weight once; on 4 KiB pages that stream takes a TLB
miss every 4 KiB and restarts the hardware prefetcher at each page. Where the kernel grants
2 MiB pages to memory that asks for them (Linux, THP `madvise` or `always`), a step of the
embedded SmolLM2 ran 7-8% faster with its weights there (Intel Xeon with AMX, 2 cores,
bench/bench_decode_step.py), and a plain read of 256 MiB ran ~15% faster.
`read_bandwidth_gbs` measures on such memory too, so the bound the benches quote is the
one the weights can reach.
"""

import logging
import mmap
import time
import weakref

import torch

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

"""The products that can compute a decoding linear (`x @ W.T` over a few rows), and the choice
among them, measured on the machine at hand and cached per machine.

Which product is fastest depends on the CPU and its BLAS: MKL's few-row SGEMM is slow on the
AMD EPYC machines, where `W @ x.T` won 2-4x, and near bandwidth on an Intel Xeon, where the same
`W @ x.T` lost 2.5-4x. So nothing is fitted: each weight shape's candidates are timed once,
with enough distinct weight copies to overflow the L3 (as a decode step's weights stream from
memory), and the choice is cached in `<cache dir>/linear_choice/<machine>.json` (cache dir:
$SPECDEC_CACHE, default ~/.cache/megatron_specdec). The entry names the CPU model, its vector
flags, core and thread counts, torch version and the built kernel; an entry whose machine
differs from this one (a copied cache, a new torch or kernel) is refused and measured again.

Rows 1..INVARIANT_ROWS (a decode step and a chain verify over k+1 <= 16 tokens) take the skinny
op (csrc/skinny_gemm.cpp) wherever it takes the dtype, however fast the others are: it is
row-invariant bitwise, so a verify forward computes each row as a plain step does and
speculative output equals greedy by construction. BLAS products are not (MKL's one-row and
eight-row SGEMMs sum in different orders), so letting one win a few buckets, or a small matrix
whose time is call overhead, breaks that on the machines where it wins. The op's schedules (the
ISA's block of weight rows prefetching the next block spread over each pass, "skinny", or in a
burst, "skinny_burst", and one row a block, "skinny_row") compute the same bits, so each row
bucket takes the fastest of them: the spread won 1 and 8 rows by 23% and 32% on an AMD EPYC
with AVX-512 and lost 1 row by 5% on an Intel Xeon with AMX. Other dtypes take one product for
all of those rows, the best over the buckets. Wider calls (batches, trees) choose per bucket.
A run of decoding layers run as one op (decode_layer.run_schedules) is timed as a whole too:
its products take their shapes' schedules or one schedule for all, whichever ran it fastest,
stored beside the shapes' choices (`run_choice`); there the products may also read weights
repacked as panels, the same bits again from a second copy of the weights.
"""

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_specdec.acceptance.ops import op_available
from megatron_specdec.models import first_use
from megatron_specdec.models.weight_memory import huge_page_empty

log = logging.getLogger(__name__)

INVARIANT_ROWS = 16
SMALL_BUCKETS = (1, 2, 4, 8, 16)
WIDE_BUCKETS = (32, 64, 128)
MAX_ROWS = WIDE_BUCKETS[-1]  # above: F.linear (a prefill), never measured
FORMAT = 3
# SPECDEC_LINEAR=<candidate> pins every shape to one product (benchmarks, comparisons).
PIN_ENV = "SPECDEC_LINEAR"
# SPECDEC_RUN=<option> pins a run of decoding layers to one of its options
# (decode_layer.run_schedules: per_shape, a schedule's name, skinny_panel), read as a run's
# schedules are first gathered for a cache and chain length.
RUN_PIN_ENV = "SPECDEC_RUN"


def skinny(x, weight):
    return torch.ops.megatron_specdec.skinny_linear(x, weight)


def skinny_row(x, weight):
    """The skinny op reading one weight row a block: a single stream through the weights."""
    return torch.ops.megatron_specdec.skinny_linear(x, weight, 1)


def skinny_burst(x, weight):
    """The skinny op's block prefetching the next block's lines in a burst at the start of
    each pass over x, not spread over it."""
    return torch.ops.megatron_specdec.skinny_linear(x, weight, 2)


def f_linear(x, weight):
    return F.linear(x, weight).contiguous()


def weight_left(x, weight):
    """`weight @ x.T`; one row is doubled, since BLAS runs the two-row product on its fast path
    (an expanded, stride-0 operand would be copied anyway)."""
    rows = x.reshape(-1, x.shape[-1])
    single = rows.shape[0] == 1
    if single:
        rows = rows.expand(2, -1).contiguous()
    out = torch.mm(weight, rows.t()).t()
    # Contiguous: a tensor-parallel all-reduce works in place on the result.
    return (out[:1] if single else out).contiguous().view(*x.shape[:-1], weight.shape[0])


CANDIDATES = {"skinny": skinny, "skinny_row": skinny_row, "skinny_burst": skinny_burst,
              "f_linear": f_linear, "weight_left": weight_left}
# The skinny op's schedules, bitwise equal products (its "schedule" argument, skinny_gemm.h).
SKINNY_SCHEDULES = {"skinny": 0, "skinny_row": 1, "skinny_burst": 2}
# Its schedule over weights repacked as panels (weight_memory.panel_copy): the same bits again,
# offered to a run of decoding layers as a whole (decode_layer.run_schedules), as it needs a
# second copy of the weights.
PANEL_SCHEDULE = 3


def candidates(dtype) -> tuple:
    """The products that take `dtype` here (the skinny op: float32, extension built)."""
    names = ("f_linear", "weight_left")
    if dtype == torch.float32 and op_available("skinny_linear"):
        names = tuple(SKINNY_SCHEDULES) + names
    return names


def skinny_schedule(fn) -> int | None:
    """The skinny op's schedule for product `fn`; None: not the skinny op."""
    return next((SKINNY_SCHEDULES[name] for name in SKINNY_SCHEDULES if CANDIDATES[name] is fn),
                None)


def _cpu_info() -> dict:
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        import platform

        model = platform.processor() or platform.machine()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    return {"cpu": model, "flags": [f for f in wanted if f in flags]}


@lru_cache(maxsize=None)
def _kernel_build() -> str:
    """A digest of the built extension: a rebuilt kernel is a new machine for the choice."""
    if not op_available("skinny_linear"):
        return "none"
    import megatron_specdec._C as ext

    digest = hashlib.sha256(Path(ext.__file__).read_bytes()).hexdigest()[:16]
    return f"{digest}/{torch.ops.megatron_specdec.skinny_linear_isa()}"


def machine() -> dict:
    """What a measured choice holds for: CPU, threads, torch, kernel build."""
    return {**_cpu_info(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernel": _kernel_build(), "format": FORMAT}


def cache_path(key: dict) -> Path:
    from megatron_specdec.models.default_model import cache_dir

    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "linear_choice" / f"{name}.json"


def _l3_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        return int(text.rstrip("KMG")) * scale
    except (OSError, ValueError, IndexError):
        return 64 << 20


def time_candidates(out_features: int, in_features: int, dtype, plan: dict,
                    repeats: int = 5, max_copies: int = 64) -> dict:
    """{name: {rows: ms a call}} for the candidates `plan` ({rows: names}) times at each row
    count: the best of `repeats` passes over distinct weight copies (together at least twice
    the L3, so they stream from memory), candidates interleaved so that other work on the
    machine falls on all of them alike."""
    weight_bytes = out_features * in_features * torch.finfo(dtype).bits // 8
    copies = max(1, min(max_copies, math.ceil(2 * _l3_bytes() / max(1, weight_bytes))))
    # On the memory decoding weights live on (models/weight_memory.py).
    weights = huge_page_empty(copies * out_features * in_features, dtype).view(
        copies, out_features, in_features).uniform_(-0.05, 0.05)
    best = {}
    with torch.no_grad():
        for rows, names in plan.items():
            x = torch.randn(rows, in_features).to(dtype)
            for name in names:
                CANDIDATES[name](x, weights[0])  # first call: allocations, dispatch
            for _ in range(repeats):
                for name in names:
                    fn = CANDIDATES[name]
                    start = time.perf_counter()
                    for w in weights:
                        fn(x, w)
                    ms = (time.perf_counter() - start) * 1e3 / copies
                    per_rows = best.setdefault(name, {})
                    per_rows[rows] = min(per_rows.get(rows, math.inf), ms)
    return best


def choose_small(times: dict) -> dict:
    """{bucket: product} for rows 1..INVARIANT_ROWS from time_candidates' result over (at
    least) SMALL_BUCKETS: the skinny op at its fastest schedule per bucket where it was timed,
    else the one product with the best mean of time / best time."""
    schedules = [name for name in SKINNY_SCHEDULES if name in times]
    if schedules:
        return {b: min(schedules, key=lambda name: times[name][b]) for b in SMALL_BUCKETS}

    def relative(name):
        return sum(times[name][b] / min(t[b] for t in times.values())
                   for b in SMALL_BUCKETS) / len(SMALL_BUCKETS)

    best = min(times, key=relative)
    return {b: best for b in SMALL_BUCKETS}


def choose(times: dict) -> dict:
    """{"small": {bucket: product} for rows 1..INVARIANT_ROWS (the skinny op's schedules, or
    one product), "wide": {bucket: product}} from time_candidates' result (rows as ints)."""
    wide = {b: min(times, key=lambda name: times[name][b]) for b in WIDE_BUCKETS}
    return {"small": choose_small(times), "wide": wide}


class KernelChoice:
    """Per weight shape and dtype, the product each row count takes on this machine."""

    def __init__(self):
        self.key = machine()
        self.path = cache_path(self.key)
        self.entries = self._load()

    def _load(self) -> dict:
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            stored, entries = data["machine"], data["entries"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("kernel choice cache %s unreadable (%s): measuring again", self.path, exc)
            return {}
        if stored != self.key:
            log.warning("kernel choice cache %s was measured on %s, not this machine (%s): "
                        "measuring again", self.path, stored, self.key)
            return {}
        return entries

    def _save(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"machine": self.key, "entries": self.entries}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("kernel choice cache %s not written (%s): the choice holds for this "
                        "process only", self.path, exc)

    @staticmethod
    def shape_key(out_features: int, in_features: int, dtype) -> str:
        return f"{out_features}x{in_features}/{str(dtype).removeprefix('torch.')}"

    def run_entry(self, key: str, bucket: int, options: tuple, measure) -> str:
        """The option (one of `options`) a run of decoding layers `key` takes at `bucket` rows:
        stored, or the fastest of measure()'s {option: ms}, stored."""
        runs = self.entries.get(f"run {key}")
        runs = runs if isinstance(runs, dict) else {}
        found = runs.get(str(bucket))
        if not isinstance(found, dict) or found.get("choice") not in options:
            times = measure()
            found = runs[str(bucket)] = {"choice": min(times, key=times.get), "ms": times}
            self.entries[f"run {key}"] = runs
            self._save()
            log.info("decoding run %s at %d rows: %s (measured: %s)", key, bucket,
                     found["choice"], ", ".join(f"{n} {ms:.2f} ms" for n, ms in times.items()))
        return found["choice"]

    def entry(self, out_features: int, in_features: int, dtype) -> dict:
        key = self.shape_key(out_features, in_features, dtype)
        found = self.entries.get(key)
        names = candidates(dtype)
        small = found.get("small") if isinstance(found, dict) else None
        if (not isinstance(small, dict) or set(small) != {str(b) for b in SMALL_BUCKETS}
                or not set(small.values()) <= set(names)):
            # Rows 1-16 take the skinny op whatever the others time: only its widths are timed.
            small_names = tuple(name for name in names if name in SKINNY_SCHEDULES) or names
            plan = {**{b: small_names for b in SMALL_BUCKETS}, **{b: names for b in WIDE_BUCKETS}}
            times = time_candidates(out_features, in_features, dtype, plan)
            chosen = choose(times)
            found = {part: {str(b): name for b, name in per_bucket.items()}
                     for part, per_bucket in chosen.items()}
            found["ms"] = times
            self.entries[key] = found
            self._save()
            log.info("linear %s: %s for 1-%d rows (measured)", key,
                     ", ".join(f"{b}: {name}" for b, name in found["small"].items()),
                     INVARIANT_ROWS)
        return found


_choice = None
_products = {}
_runs = {}


def bucket_of(rows: int) -> int:
    """The row bucket (SMALL_BUCKETS, then WIDE_BUCKETS) whose choice `rows` rows take."""
    return next(b for b in SMALL_BUCKETS + WIDE_BUCKETS if rows <= b)


def product(weight: torch.Tensor, rows: int):
    """The function computing `x @ weight.T` for `rows` rows (<= MAX_ROWS) on this machine."""
    global _choice
    out_features, in_features = weight.shape
    bucket = bucket_of(rows)
    key = (out_features, in_features, weight.dtype, bucket)
    fn = _products.get(key)
    if fn is None:
        pinned = os.environ.get(PIN_ENV)
        if pinned:
            if pinned not in CANDIDATES:
                raise ValueError(f"{PIN_ENV}={pinned!r}; expected one of {tuple(CANDIDATES)}")
            name = pinned if pinned in candidates(weight.dtype) else "f_linear"
        else:
            _choice = _choice or KernelChoice()
            found = _choice.entry(out_features, in_features, weight.dtype)
            name = found["small" if rows <= INVARIANT_ROWS else "wide"][str(bucket)]
        fn = _products[key] = CANDIDATES[name]
        first_use.note()
    return fn


def run_choice(key: str, rows: int, options: tuple, measure) -> str | None:
    """The option a run of decoding layers `key` (its products' shapes) takes for `rows` (at
    most INVARIANT_ROWS) rows on this machine: read from the cache, or the fastest of
    `measure()`'s {option: ms}; SPECDEC_RUN's where it pins one, else None where SPECDEC_LINEAR
    pins the products."""
    global _choice
    pinned = os.environ.get(RUN_PIN_ENV)
    if pinned:
        if pinned not in options:
            raise ValueError(f"{RUN_PIN_ENV}={pinned!r}; this run's options here are {options}")
        return pinned
    if os.environ.get(PIN_ENV):
        return None
    bucket = bucket_of(rows)
    name = _runs.get((key, bucket))
    if name is None:
        _choice = _choice or KernelChoice()
        name = _runs[key, bucket] = _choice.run_entry(key, bucket, options, measure)
        first_use.note()
    return name


def reset():
    """Forget the choices of this process (the next call reads the cache again)."""
    global _choice
    _choice = None
    _products.clear()
    _runs.clear()

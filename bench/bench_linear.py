"""The few-row products of decoding against the machine's memory bandwidth: the skinny op
(csrc/skinny_gemm.cpp) at each of its schedules, `F.linear` (what stock transformers and
megatron run) and `W @ x.T`, for every weight shape of SmolLM2-135M and of an 8B Llama (Llama
3.1 8B) at 1-16 rows.

A weight smaller than twice the L3 is multiplied as distinct copies in turn, so it streams
from memory as in a decode step (models/layers/linear_kernels.time_candidates). Each cell prints
milliseconds a product and its fraction of the read bound (weight bytes / measured read
bandwidth: 1.0 = at the bound), and which product the kernel choice takes for the shape at
that row count.

    python bench/bench_linear.py [--models smollm2 llama8b] [--rows 1 2 4 8 16] [--repeats 3]

Writes bench/results/linear.json with the CPU model, its flags, threads, the measured read
bandwidth, the skinny op's ISA path, the commit and the load average.
"""
import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from megatron_specdec.models.layers.linear_kernels import (
    SMALL_BUCKETS,
    candidates,
    choose_small,
    machine,
    time_candidates,
)

SHAPES = {
    "smollm2": {"qkv": (960, 576), "o_proj": (576, 576), "fc1": (3072, 576),
                "fc2": (576, 1536), "lm_head": (49152, 576)},
    "llama8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "fc1": (28672, 4096),
                "fc2": (4096, 14336), "lm_head": (128256, 4096)},
}


class ReadProbe:
    """The machine's streaming read rate, sampled as often as a run asks: GB/s of a sum over
    `mib` MiB of float32 on torch's threads (the best of `repeats`), the read a batch-1 decode
    step is bound by, on memory placed as the decoding weights are (models/weight_memory.py:
    huge pages where the kernel grants them). The buffer is kept between samples; a shared
    machine's rate can move twofold from minute to minute."""

    def __init__(self, mib: int = 256):
        from megatron_specdec.models.weight_memory import huge_page_empty

        self.data = huge_page_empty(mib * (1 << 20) // 4).fill_(1.0)

    def __call__(self, repeats: int = 7) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self.data.sum()
            best = min(best, time.perf_counter() - start)
        return self.data.numel() * 4 / best / 1e9


def read_bandwidth_gbs(mib: int = 256, repeats: int = 7) -> float:
    """One sample of ReadProbe's read rate."""
    return ReadProbe(mib)(repeats)


def commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True).stdout.strip()
        return rev + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_report(out: Path, report: dict, indent: int = 1):
    """A bench's JSON report at `out` (its folder made), written to a temporary file and
    renamed."""
    from megatron_specdec.checkpointing.checkpoint import write_text_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(report, indent=indent) + "\n")


def describe_machine() -> dict:
    """What every speed figure of the project names: CPU, flags, threads, torch, commit."""
    return {**machine(), "read_bandwidth_gb_s": read_bandwidth_gbs(), "commit": commit(),
            "load_average_1min": os.getloadavg()[0]}


def main():
    from megatron_specdec.cli.common import setup_logging

    setup_logging()  # quiet logs: benign library warnings off
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=list(SMALL_BUCKETS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "linear.json"))
    args = p.parse_args()
    if min(args.rows) < 1:
        raise SystemExit(f"--rows {args.rows}: every row count must be >= 1")
    torch.manual_seed(0)
    about = describe_machine()
    bandwidth = about["read_bandwidth_gb_s"]
    print(f"{about['cpu']} ({' '.join(about['flags'])}), {about['threads']} threads, torch "
          f"{about['torch']}, skinny path {about['kernel'].split('/')[-1]}, commit "
          f"{about['commit']}; read bandwidth {bandwidth:.1f} GB/s, load {about['load_average_1min']:.1f}")
    names = candidates(torch.float32)
    results = {}
    print(f"{'shape':18}{'rows':>5}" + "".join(f"{n + ' ms':>15}{'of bound':>9}" for n in names)
          + "  chosen")
    for model in args.models:
        for layer, (out_features, in_features) in SHAPES[model].items():
            times = time_candidates(out_features, in_features, torch.float32,
                                    {rows: names for rows in args.rows}, args.repeats)
            bound_ms = out_features * in_features * 4 / (bandwidth * 1e9) * 1e3
            chosen = choose_small(times) if set(SMALL_BUCKETS) <= set(args.rows) else None
            key = f"{model}/{layer} {out_features}x{in_features}"
            results[key] = {"bound_ms": bound_ms, "chosen_for_1_to_16_rows": chosen, "rows": {
                rows: {name: {"ms": times[name][rows], "of_bound": bound_ms / times[name][rows]}
                       for name in names} for rows in args.rows}}
            for rows in args.rows:
                cells = "".join(f"{times[n][rows]:>15.3f}{bound_ms / times[n][rows]:>9.2f}"
                                for n in names)
                print(f"{model + '/' + layer:18}{rows:>5}{cells}  {(chosen or {}).get(rows, '')}",
                      flush=True)
    about["load_average_1min_after"] = os.getloadavg()[0]
    report = {"machine": about, "what": "ms a product x[rows, in] @ W[out, in].T, float32; "
              "of_bound = (weight bytes / read bandwidth) / ms", "results": results}
    out = Path(args.out)
    write_report(out, report, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

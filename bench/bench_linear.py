"""Operand order for the few-row products of decoding: `F.linear(x, W)` (what stock
transformers and megatron run) against `W @ x.T` (layers/small_rows_linear.py), for
SmolLM2's weight shapes and 1-128 rows. Each cell multiplies by 30 distinct weights (one per
layer, so the weights stream from memory as in a decode step; the lm_head once).

    python bench/bench_linear.py [--repeats 15]

Prints milliseconds per 30 products and writes bench/results/linear.json.
"""
import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_specdec.layers.linear_kernels import weight_left as small_rows_linear

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "fc1": (3072, 576), "fc2": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def quantile_ms(fn, repeats):
    """Lower-quartile wall time: less sensitive than the median to other work on the machine."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4] * 1e3


def main():
    from megatron_specdec.cli import setup_logging

    setup_logging()  # quiet logs: benign library warnings off
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "linear.json"))
    args = p.parse_args()
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    results = {}
    print(f"{'shape':8}{'rows':>6}{'F.linear ms':>13}{'W @ x.T ms':>12}{'ratio':>7}")
    for name, (out_features, in_features) in SHAPES.items():
        weights = [torch.randn(out_features, in_features)
                   for _ in range(1 if name == "lm_head" else 30)]
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            linear = quantile_ms(lambda: [F.linear(x, w) for w in weights], args.repeats)
            ours = quantile_ms(lambda: [small_rows_linear(x, w) for w in weights], args.repeats)
            results[f"{name}/{rows}"] = {"f_linear_ms": linear, "weight_left_ms": ours}
            print(f"{name:8}{rows:>6}{linear:>13.2f}{ours:>12.2f}{linear / ours:>7.2f}")
    report = {"machine": f"{platform.processor() or platform.machine()}, "
                         f"{torch.get_num_threads()} torch threads, torch {torch.__version__}",
              "load_average_1min": [load, os.getloadavg()[0]], "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

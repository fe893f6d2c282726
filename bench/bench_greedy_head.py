"""The greedy output head against the float32 logits and an argmax, on the embedded SmolLM2's
output layer (49,152 x 576) at 1-16 rows of x: what a plain greedy step (1 row) and a verify
forward (k + 1 rows) pay for their next-token ids.

The head (csrc/greedy_head.cpp) screens every logit from an int8 copy of the weight and
computes only the candidates again in float32; the logits path is the decoding product the
kernel choice takes for the shape (models/layers/linear_kernels.product) and torch.argmax.
Rows of x are Gaussian rows times the final norm's weight, the scale of a final-norm output.
Both give the same ids (tests/test_greedy_head.py); here each is timed, the two interleaved.

    python bench/bench_greedy_head.py [--rows 1 2 4 8 16] [--repeats 50] \
        [--out bench/results/greedy_head.json]

Writes the CPU model, threads, the skinny op's ISA path, the commit, the date and the load
average with the medians.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import commit, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "greedy_head.json"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    from megatron_specdec.models.layers.linear_kernels import INVARIANT_ROWS
    if args.repeats < 1 or not all(1 <= r <= INVARIANT_ROWS for r in args.rows):
        raise SystemExit(f"--repeats {args.repeats} --rows {args.rows}: expected repeats >= 1 and "
                         f"rows in 1..{INVARIANT_ROWS}")

    from megatron_specdec import distributed
    from megatron_specdec.cli.common import setup_logging
    from megatron_specdec.loading.hf_conversion import model_from_hf
    from megatron_specdec.models.default_model import default_model_dir
    from megatron_specdec.models.layers.greedy_head import greedy_head
    from megatron_specdec.models.layers.linear_kernels import machine, product

    setup_logging()
    distributed.initialize(1, 1)
    base, _ = model_from_hf(default_model_dir())
    weight = base.shared_embedding_or_output_weight().detach()
    norm = base.decoder.final_layernorm.weight.detach()
    g = torch.Generator().manual_seed(0)
    xs = {r: torch.randn(r, weight.shape[1], generator=g) * norm for r in args.rows}
    load_before = os.getloadavg()[0]
    times = {path: {r: [] for r in args.rows} for path in ("greedy_head", "logits_argmax")}
    with torch.no_grad():
        heads = {r: greedy_head(weight, weight.shape[0], r) for r in args.rows}
        if any(h is None for h in heads.values()):
            raise SystemExit("the greedy head does not run on this machine (no vector path, or a "
                             "pinned product): nothing to compare")
        for _ in range(args.repeats + 3):  # three warm-up rounds
            for r in args.rows:
                start = time.perf_counter()
                heads[r](xs[r])
                times["greedy_head"][r].append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                product(weight, r)(xs[r], weight).argmax(-1)
                times["logits_argmax"][r].append((time.perf_counter() - start) * 1e3)
    median = {path: {r: statistics.median(t[3:]) for r, t in by_r.items()}
              for path, by_r in times.items()}
    report = {
        "machine": machine(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
        "load_average_1min": [load_before, os.getloadavg()[0]], "repeats": args.repeats,
        "isa": torch.ops.megatron_specdec.skinny_linear_isa(),
        "weight": list(weight.shape),
        "ms": {path: {str(r): round(ms, 3) for r, ms in by_r.items()} for path, by_r in median.items()},
    }
    out = Path(args.out)
    write_report(out, report)
    m = report["machine"]
    print(f"{m['cpu']} ({', '.join(m['flags'])}), {m['threads']} threads; output layer "
          f"{weight.shape[0]} x {weight.shape[1]}")
    print("| rows | greedy head ms | float32 logits + argmax ms | x one row (head) |")
    print("|---|---|---|---|")
    for r in args.rows:
        print(f"| {r} | {median['greedy_head'][r]:.2f} | {median['logits_argmax'][r]:.2f} | "
              f"{median['greedy_head'][r] / median['greedy_head'][args.rows[0]]:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""A run of decoding layers under each of its options, side by side: the embedded SmolLM2
(batch 1, 128-token context) decoding forwards of q = 1 and 8 tokens (a plain step, a chain
verify of 7 drafts; `--queries` adds others, such as an adaptive policy's 2-4) with the
decode_layers op pinned (SPECDEC_RUN) to each option of decode_layer.run_schedules in turn:
`per_shape`, one of the skinny op's schedules for every product, or `skinny_panel` (every
product from its panel copy). All options compute the same
bits; this shows which is fastest here and what an 8-token forward costs in one-token ones.
Runners interleaved option by option within each round, so that other work on the machine
falls on all of them alike; each figure the median of `rounds`.

    python bench/bench_run_options.py [--rounds 40] [--bf16-values] [--queries 1,2,4,8] \
        [--options per_shape,skinny,skinny_panel] [--out bench/results/run_options.json]

`--bf16-values` first rounds every weight to a bfloat16 value, as a base trained in bf16
holds them: the products then read their 16-bit copies (and those copies' panels).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import describe_machine, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "run_options.json"
CONTEXT = 128


def main():
    from megatron_specdec import distributed
    from megatron_specdec.cli.common import setup_logging
    from megatron_specdec.inference.generation import StageRunner
    from megatron_specdec.loading.hf_conversion import model_from_hf
    from megatron_specdec.models.default_model import default_model_dir
    from megatron_specdec.models.layers.linear_kernels import RUN_PIN_ENV

    setup_logging()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--options", default="per_shape,skinny,skinny_row,skinny_panel",
                   help="comma-separated options of the run (decode_layer.run_schedules)")
    p.add_argument("--bf16-values", action="store_true")
    p.add_argument("--queries", default="1,8",
                   help="comma-separated tokens a forward (1 and 8 always among them)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    options = args.options.split(",")
    try:
        queries = sorted({1, 8, *(int(q) for q in args.queries.split(","))})
    except ValueError:
        p.error(f"--queries {args.queries!r}: expected comma-separated integers such as 1,2,4,8")
    if not 1 <= queries[0] <= queries[-1] <= 16:
        p.error(f"--queries {args.queries!r}: each must be 1-16 (the decoding op's rows)")

    distributed.initialize(1, 1)
    machine = describe_machine()  # read bandwidth and load before the runs
    base, _ = model_from_hf(default_model_dir())
    base.eval()
    if args.bf16_values:
        with torch.no_grad():
            for param in base.parameters():
                param.copy_(param.bfloat16().float())
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, base.vocab_size, (1, CONTEXT), generator=g)
    runners, times = {}, {o: {q: [] for q in queries} for o in options}
    outputs = {}
    try:
        with torch.no_grad():
            for option in options:
                os.environ[RUN_PIN_ENV] = option  # read as each runner's run is first gathered
                runners[option] = StageRunner(base, 1, CONTEXT + max(queries) + 1,
                                              base.vocab_size)
                runners[option].step(prompt, last_only=True)
            for _ in range(args.rounds + 2):  # two warm-up rounds
                for q in queries:
                    tokens = torch.randint(0, base.vocab_size, (1, q), generator=g)
                    for option, runner in runners.items():
                        os.environ[RUN_PIN_ENV] = option
                        start = time.perf_counter()
                        out = runner.step(tokens, greedy=True)
                        times[option][q].append((time.perf_counter() - start) * 1e3)
                        outputs.setdefault(q, {})[option] = out.clone()
                        runner.rewind(q)
                    first = next(iter(outputs[q].values()))
                    assert all(torch.equal(ids, first) for ids in outputs[q].values()), \
                        f"the options' greedy ids differ at q={q}"
    finally:
        os.environ.pop(RUN_PIN_ENV, None)
    median = {o: {q: statistics.median(t[2:]) for q, t in by_q.items()} for o, by_q in times.items()}
    report = {
        "machine": machine, "date": time.strftime("%Y-%m-%d"),
        "weights": "bf16 values" if args.bf16_values else "as loaded", "context": CONTEXT,
        "rounds": args.rounds, "load_average_1min_after": os.getloadavg()[0],
        "forward_ms": {o: {str(q): round(ms, 2) for q, ms in by_q.items()}
                       for o, by_q in median.items()},
        "eight_over_one": {o: round(by_q[8] / by_q[1], 3) for o, by_q in median.items()},
    }
    out = Path(args.out)
    write_report(out, report)
    m = report["machine"]
    print(f"{m['cpu']} ({', '.join(m['flags'])}), {m['threads']} threads, read "
          f"{m['read_bandwidth_gb_s']:.1f} GB/s, weights {report['weights']}")
    print("| option | " + " | ".join(f"{q} tokens ms" for q in queries) + " | 8 / 1 |")
    print("|---|" + "---|" * (len(queries) + 1))
    for o, by_q in median.items():
        print(f"| {o} | " + " | ".join(f"{by_q[q]:.2f}" for q in queries)
              + f" | {report['eight_over_one'][o]:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

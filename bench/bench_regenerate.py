"""Self-distillation throughput: the regenerator (`python -m megatron_specdec.cli.data regenerate`,
Megatron backend) answering steered prompts greedily, once per parameter dtype, in one process.

The draft's data is what limits it (issue 14), and on a CPU its generation costs more than
its training, so the figure that matters is completion tokens/s at the data recipe's batch.
Each dtype answers the same prompts through `regenerate` itself (chat template, end-of-turn
stop, finished rows leaving the batch); outputs are compared row by row with the first
dtype's. Table on stdout, JSON in bench/results/regenerate.json.

    python bench/bench_regenerate.py [--num-prompts 64] [--max-new-tokens 128]
        [--batch-size 64] [--dtypes float32 bfloat16] [--profile]

On a GPU (it runs there when torch sees one): `--prompts data/smollm2_synth_steered9_prompts.jsonl.gz
--num-prompts 4096 --batch-size 2048 --max-new-tokens 256`. `--profile` runs each dtype under
torch.profiler and prints the ops that took the most time (device time on a GPU): where a
regeneration step goes.
"""

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "regenerate.json"
PROMPTS = ROOT / "data" / "smollm2_synth_steered3_prompts.jsonl.gz"


def answer(dtype, rows, args, out_path):
    """(the regenerator's RegenStats, its answers, the profile table or None) at `dtype`;
    with --profile only the generation runs under torch.profiler, not the model's loading."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from megatron_specdec.data import regenerate
    from megatron_specdec.inference.data_backend import MegatronBackend
    from megatron_specdec.distributed import destroy

    backend = MegatronBackend("default", dtype=dtype)
    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    prof = profile(activities=activities) if args.profile else contextlib.nullcontext()
    try:
        with prof:
            stats = regenerate(rows, backend, backend.tokenizer, out_path, args.batch_size,
                               args.max_new_tokens, progress=False)
    finally:
        destroy()
    answers = [json.loads(line)["conversations"][-1]["content"]
               for line in out_path.read_text().splitlines()]
    table = None
    if args.profile:
        key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=25)
    return stats, answers, table


def main():
    from megatron_specdec.data.sources import read_sources

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=str(PROMPTS), help="jsonl(.gz) with a prompt field")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"),
                   default=["float32", "bfloat16"])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--profile", action="store_true", help="profile each dtype's run (slower)")
    args = p.parse_args()

    spec = json.dumps({"name": "bench", "file": args.prompts, "prompt": "prompt"})
    rows = read_sources([spec], on_error="fail")[: args.num_prompts]
    load_before = os.getloadavg()
    results, first = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            stats, answers, table = answer(dtype, rows, args, Path(tmp) / f"{dtype}.jsonl")
            if table:
                print(table, flush=True)
            rate = stats.completion_tokens / stats.seconds
            first = first or answers
            results[dtype] = {"completion_tokens": stats.completion_tokens,
                              "seconds": stats.seconds, "tokens_per_s": rate,
                              "identical_to_first": f"{sum(a == b for a, b in zip(answers, first))}"
                                                    f"/{len(rows)}"}
            print(f"{dtype:>9}: {stats.completion_tokens} tokens in {stats.seconds:.1f} s, "
                  f"{rate:.1f} tokens/s, {results[dtype]['identical_to_first']} answers as "
                  f"{args.dtypes[0]}", flush=True)
    report = {"what": "regenerator throughput (Megatron backend, greedy) by parameter dtype",
              "prompts": os.path.relpath(args.prompts, ROOT), "num_prompts": len(rows),
              "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
              "results": results,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "profiled": args.profile,
              "torch": torch.__version__,
              "load_average_before_after": [load_before, os.getloadavg()]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from megatron_specdec.cli.common import setup_logging

    setup_logging("WARNING")  # before megatron-core is imported: its benign warnings stay out
    main()

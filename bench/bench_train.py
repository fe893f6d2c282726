"""Training throughput and peak memory of the shipped EAGLE3 SmolLM2 recipe: online vs
offline mode, TP=1 vs TP=2 (torchrun), short runs.

Each configuration is a real launch of `python -m megatron_specdec.cli.train` (under
`torch.distributed.run` for TP=2) on GSM8K question/answer conversations. Throughput is the
median tokens/s (input tokens, padding included, over all ranks) of the steps after the
first; setup is the time from launch to the first step (offline: includes dumping the base
states); peak memory is the largest RSS sum over the launcher and every rank. The machine's
load average is recorded: on a shared CPU other work moves these figures a lot.

    python bench/bench_train.py [--steps 5] [--seq-length 128] [--dtypes float32 bfloat16]
        [--configs online:1 offline:1 online:2 offline:2]   # table + bench/results/train.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from proc_peak import run_measured

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "train.json"
CONFIGS = [("online", 1), ("offline", 1), ("online", 2), ("offline", 2)]


def write_conversations(src: Path, out: Path, n: int) -> Path:
    with open(src) as f, open(out, "w") as g:
        for i, line in zip(range(n), f):
            row = json.loads(line)
            g.write(json.dumps({"id": f"gsm8k:{i}", "conversations": [
                {"role": "user", "content": row["question"]},
                {"role": "assistant", "content": row["answer"]}]}) + "\n")
    return out


def launch(mode: str, tp: int, dtype: str, args, data: Path, work: Path) -> dict:
    out = work / f"{mode}_tp{tp}_{dtype}"
    overrides = [f"output_dir={out}", f"data.train=[{data}]", f"data.seq_length={args.seq_length}",
                 f"model.dtype={dtype}",
                 f"training.steps={args.steps}", "training.micro_batch_size=1",
                 "training.global_batch_size=2", f"training.mode={mode}",
                 f"parallelism.tp={tp}", f"draft.config.ttt_steps={args.ttt_steps}",
                 "checkpointing.interval=0", "evaluation.interval=0", "logging.interval=1",
                 "logging.progress_bar=false", "logging.tensorboard=false"]
    launcher = [sys.executable]
    if tp > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
    cmd = launcher + ["-m", "megatron_specdec.cli.train", "--config",
                      str(REPO / "recipes" / "eagle3_smollm2.yaml"), *overrides]
    launched = time.time()
    wall, peak_mib = run_measured(cmd, cwd=REPO)
    records = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {"mode": mode, "tp": tp, "dtype": dtype, "tokens_per_s": statistics.median(
                r["tokens_per_s"] for r in steps[1:]),
            "setup_s": steps[0]["time"] - launched, "wall_s": wall, "peak_rss_mib": peak_mib,
            "final_loss": steps[-1]["loss"]}


def main():
    from megatron_specdec.cli.common import setup_logging

    setup_logging()  # quiet logs: benign library warnings off
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=64, help="GSM8K conversations to train on")
    p.add_argument("--data-dir", default=str(REPO / "data" / "sources"))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   help="model.dtype of each run (bfloat16: fp32 master weights)")
    p.add_argument("--configs", nargs="+", default=[f"{m}:{t}" for m, t in CONFIGS],
                   help="mode:tp pairs to run")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = write_conversations(Path(args.data_dir) / "gsm8k_train.jsonl",
                                   Path(tmp) / "conv.jsonl", args.rows)
        runs = [(dtype, mode, int(tp)) for dtype in args.dtypes
                for mode, tp in (c.split(":") for c in args.configs)]
        for dtype, mode, tp in runs:
            rows.append(launch(mode, tp, dtype, args, data, Path(tmp)))
            r = rows[-1]
            print(f"{dtype:8s} {mode:8s} TP={tp}  {r['tokens_per_s']:8.1f} tok/s  setup "
                  f"{r['setup_s']:6.1f} s  peak {r['peak_rss_mib']:7.0f} MiB  "
                  f"loss {r['final_loss']:.3f}", flush=True)
    result = {"model": "SmolLM2-135M-Instruct", "recipe": "recipes/eagle3_smollm2.yaml",
              "seq_length": args.seq_length, "steps": args.steps,
              "global_batch_size": 2, "ttt_steps": args.ttt_steps,
              "machine": platform.machine(), "cpus": torch.get_num_threads(),
              "torch": torch.__version__, "load_average_at_end": os.getloadavg(), "runs": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"\n{'dtype':9s}{'mode':8s} {'TP':>3s} {'tokens/s':>9s} {'setup s':>8s} {'peak MiB':>9s}")
    for r in rows:
        print(f"{r['dtype']:9s}{r['mode']:8s} {r['tp']:3d} {r['tokens_per_s']:9.1f} {r['setup_s']:8.1f} "
              f"{r['peak_rss_mib']:9.0f}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

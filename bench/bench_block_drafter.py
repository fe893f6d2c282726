"""DFlash vs EAGLE3 from scratch at equal training tokens on the same data: both recipes'
drafts trained with the same sequences, order, length, batch and step count (so the same
input tokens), learning curves of both in one plot (per-position top-1 accuracy of the
scored tokens, and the greedy acceptance length those accuracies imply,
1 + sum_k prod_{i<=k} acc_i, an estimate from teacher-forced accuracies, not a measured AL).

    python bench/bench_block_drafter.py --steps 30 --seq-length 256 --global-batch-size 2

Writes bench/results/block_drafter_vs_eagle3_from_scratch.json and .png (CPU model, commit
and load average recorded). Each run is `python -m megatron_specdec.cli.train` on its recipe
(recipes/eagle3_smollm2.yaml, recipes/dflash_smollm2.yaml) with the overrides below.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"eagle3": "recipes/eagle3_smollm2.yaml", "dflash": "recipes/dflash_smollm2.yaml"}
RESULT = "block_drafter_vs_eagle3_from_scratch"


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=REPO).stdout.strip()


def implied_al(accuracy) -> float:
    """1 + sum_k prod_{i<=k} acc_i over the draft positions (independence assumed)."""
    total, chain = 1.0, 1.0
    for a in accuracy:
        chain *= a
        total += chain
    return total


def train(algo: str, out_dir: Path, args) -> subprocess.Popen:
    overrides = [f"output_dir={out_dir}", f"training.steps={args.steps}",
                 f"data.seq_length={args.seq_length}",
                 f"training.global_batch_size={args.global_batch_size}",
                 "training.micro_batch_size=1", f"optimizer.warmup_steps={args.warmup}",
                 "checkpointing.interval=0", "checkpointing.resume=false",
                 "evaluation.interval=0", "logging.interval=1"]
    if algo == "dflash":  # blocks tiling the whole row: every position scored, as EAGLE3 does
        overrides.append(f"draft.config.anchors_per_sequence={args.seq_length // 8}")
    log = open(out_dir.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, "-m", "megatron_specdec.cli.train", "--config",
                             RECIPES[algo], *overrides], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)


def _finished(out_dir: Path, steps: int) -> bool:
    log = out_dir / "train_log.jsonl"
    return log.is_file() and any(json.loads(line).get("event") == "end"
                                 and json.loads(line)["step"] == steps
                                 for line in log.read_text().splitlines())


def curve(out_dir: Path) -> list:
    rows = []
    for line in (out_dir / "train_log.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "accuracy" in r:
            rows.append({"step": r["step"], "loss": r["loss"], "accuracy": r["accuracy"],
                         "implied_al": implied_al(r["accuracy"])})
    return rows


def held_out_prompts(path: Path, n: int) -> Path:
    """GSM8K training questions far past the ones the committed data answers (its first
    4,080): prompts neither draft trained on (never MT-bench)."""
    rows = (REPO / "data/sources/gsm8k_train.jsonl").read_text().splitlines()[7000:7000 + n]
    path.write_text("".join(json.dumps({"prompt": json.loads(r)["question"]}) + "\n"
                            for r in rows))
    return path


def measure(ckpt: str, prompts: str, out: str, max_new_tokens: int):
    """Greedy acceptance length of a trained checkpoint (chain of 7, fixed), in this process."""
    from megatron_specdec.evaluation.acceptance import evaluate_acceptance

    report = evaluate_acceptance(ckpt, prompts, max_new_tokens=max_new_tokens,
                                 num_draft_tokens=7, policy="fixed", progress=False)
    report.pop("per_prompt", None)
    Path(out).write_text(json.dumps(report, indent=1, default=str) + "\n")


def measured(work: Path, algo: str, args) -> dict:
    prompts = held_out_prompts(work / "held_out_prompts.jsonl", args.al_prompts)
    out = work / f"{algo}_acceptance.json"
    subprocess.run([sys.executable, __file__, "--measure", str(work / algo / "final"),
                    str(prompts), str(out), "--al-new-tokens", str(args.al_new_tokens)],
                   cwd=REPO, check=True)
    return json.loads(out.read_text())


def round_cost(out: Path, new_tokens: int, repeats: int):
    """One speculative round's cost at k=7 against a plain greedy step, SmolLM2-135M + a fresh
    DFlash draft (the cost does not depend on what the draft learned): seconds per round of
    drafting (one draft forward) and of verifying (one base forward over 8 tokens), and the
    plain greedy seconds per token, medians over `repeats` generations of one prompt."""
    import statistics

    import torch

    from megatron_specdec import distributed
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.loading.hf_conversion import model_from_hf, read_hf_config
    from megatron_specdec.models.default_model import default_model_dir
    from megatron_specdec.models.speculative import convert

    distributed.initialize(1, 1)
    hf_dir = default_model_dir()
    hf = read_hf_config(hf_dir)
    model = convert(model_from_hf(hf_dir, dtype=torch.bfloat16)[0], "dflash",
                    {"num_layers": 1}, hf_config=hf).eval()
    prompt = json.loads((REPO / "data/sources/gsm8k_train.jsonl").read_text()
                        .splitlines()[7000])["question"]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    generator = SpeculativeGenerator(model, 7, policy="fixed")
    plain, draft, verify = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        plain_generate(model.base, [ids], new_tokens, hf.vocab_size)
        plain.append((time.perf_counter() - started) / new_tokens)
        r = generator.generate(ids, new_tokens)
        rounds = len(r.accepted)
        draft.append(r.seconds["draft"] / rounds)
        verify.append(r.seconds["base"] / rounds)
    med = {k: statistics.median(v) for k, v in
           (("plain_step_s", plain), ("draft_per_round_s", draft), ("verify_per_round_s", verify))}
    med["round_over_plain_step"] = (med["draft_per_round_s"] + med["verify_per_round_s"]) / med["plain_step_s"]
    med["draft_over_plain_step"] = med["draft_per_round_s"] / med["plain_step_s"]
    result = {"what": "DFlash round cost at k=7 vs a plain greedy step, SmolLM2-135M bf16",
              "cpu": cpu_model(), "commit": commit(), "load_average": os.getloadavg(),
              "new_tokens": new_tokens, "repeats": repeats, "median": med,
              "note": "verify and plain-step times include the prefill share; the draft "
                      "includes reading accepted states into its context cache"}
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def plot(result: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for algo, rows in result["curves"].items():
        tokens = [r["step"] * result["tokens_per_step"] for r in rows]
        ax[0].plot(tokens, [r["implied_al"] for r in rows], label=algo)
        ax[1].plot(tokens, [r["accuracy"][0] for r in rows], label=algo)
    ax[0].set(xlabel="training input tokens", ylabel="implied AL (teacher-forced accuracies)")
    ax[1].set(xlabel="training input tokens", ylabel="top-1 accuracy, draft position 1")
    for a in ax:
        a.legend()
    fig.suptitle(f"from scratch, same data; {result['cpu']} @ {result['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--global-batch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--work-dir", default="runs/bench_block_drafter")
    p.add_argument("--window", type=int, default=5, help="steps averaged for the final figures")
    p.add_argument("--reuse", action="store_true",
                   help="keep a run of --work-dir that already reached --steps (same settings)")
    p.add_argument("--commit", help="the commit to record (default: this checkout's HEAD; a "
                                    "copied tree run away from a moving checkout names it)")
    p.add_argument("--al-prompts", type=int, default=4,
                   help="held-out prompts for the measured acceptance length (0: none)")
    p.add_argument("--al-new-tokens", type=int, default=48)
    p.add_argument("--measure", nargs=3, metavar=("CKPT", "PROMPTS", "OUT"),
                   help=argparse.SUPPRESS)  # one checkpoint's acceptance, in a fresh process
    p.add_argument("--round-cost", action="store_true",
                   help="only measure a k=7 round's cost against a plain step "
                        "(bench/results/block_drafter_round_cost.json)")
    args = p.parse_args()
    if args.round_cost:
        return round_cost(REPO / "bench/results/block_drafter_round_cost.json", 32, 3)
    if args.measure:
        return measure(*args.measure, args.al_new_tokens)
    work = REPO / args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    load_before, started = os.getloadavg(), time.time()
    procs = {algo: train(algo, work / algo, args) for algo in RECIPES  # side by side
             if not (args.reuse and _finished(work / algo, args.steps))}
    for algo, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{algo} training failed: see {work / algo}.log")
    curves = {algo: curve(work / algo) for algo in RECIPES}
    final = {algo: {k: sum(r[k] for r in rows[-args.window:]) / len(rows[-args.window:])
                    for k in ("loss", "implied_al")} for algo, rows in curves.items()}
    result = {
        "what": "DFlash vs EAGLE3 drafts trained from scratch on the same data, equal input tokens",
        "cpu": cpu_model(), "commit": args.commit or commit(), "seconds": time.time() - started,
        "load_average_before_after": [load_before, os.getloadavg()],
        "steps": args.steps, "seq_length": args.seq_length,
        "dflash_anchors_per_sequence": args.seq_length // 8,
        "global_batch_size": args.global_batch_size,
        "tokens_per_step": args.seq_length * args.global_batch_size,
        "final_mean_of_last_steps": final,
        "implied_al_ratio_dflash_over_eagle3": final["dflash"]["implied_al"] / final["eagle3"]["implied_al"],
        "curves": curves,
        "measured_acceptance": ({algo: measured(work, algo, args) for algo in RECIPES}
                                if args.al_prompts else None),
    }
    out = REPO / "bench" / "results" / f"{RESULT}.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("cpu", "commit", "final_mean_of_last_steps",
                                             "implied_al_ratio_dflash_over_eagle3")}, indent=1))


if __name__ == "__main__":
    main()

"""DFlash vs EAGLE3 from scratch at equal training tokens on the same data: both recipes'
drafts trained with the same sequences, order, length, batch and step count (so the same
input tokens), learning curves of both in one plot: the greedy acceptance length measured on
held-out prompts at every checkpoint, and the per-position top-1 accuracy of the scored tokens
with the acceptance length those imply, 1 + sum_k prod_{i<=k} acc_i (an estimate from
teacher-forced accuracies, not a measured AL).

    python bench/bench_block_drafter.py --steps 30 --seq-length 256 --global-batch-size 2
    # the recipes as shipped (rows of 512, 8 a step, 1600-step schedule), their first 250 steps:
    python bench/bench_block_drafter.py --steps 250 --schedule-steps 1600 --seq-length 512 \
        --global-batch-size 8 --warmup 50 --checkpoint-interval 50 --al-prompts 4 \
        --al-new-tokens 64 --measure-steps 250 --name block_drafter_vs_eagle3_recipes

Writes bench/results/<--name>.json and .png (CPU model, commit
and load average recorded). Each run is `python -m megatron_specdec.cli.train` on its recipe
(recipes/eagle3_smollm2.yaml, recipes/dflash_smollm2.yaml) with the overrides below; runs
resume, so an interrupted bench continues where it stopped. Checkpoints are measured through
the product's path: export_draft, import_draft onto the run's final checkpoint, validate.
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


def dflash_config(args) -> dict:
    """The DFlash run's draft.config overrides: --dflash-config KEY=VALUE over blocks of
    seq_length / 8 a row (blocks of 8 then score about as many draft positions as the row has
    tokens; EAGLE3's 7 TTT steps score seven per token)."""
    return {"anchors_per_sequence": str(args.seq_length // 8),
            **dict(kv.split("=", 1) for kv in args.dflash_config)}


def train(algo: str, out_dir: Path, args) -> subprocess.Popen:
    overrides = [f"output_dir={out_dir}", f"training.steps={args.schedule_steps or args.steps}",
                 f"data.seq_length={args.seq_length}",
                 f"training.global_batch_size={args.global_batch_size}",
                 "training.micro_batch_size=1", f"optimizer.warmup_steps={args.warmup}",
                 f"checkpointing.interval={args.checkpoint_interval}",
                 f"checkpointing.keep_last={args.steps // max(args.checkpoint_interval, 1) + 1}",
                 "checkpointing.resume=true", "evaluation.interval=0", "logging.interval=1"]
    if args.schedule_steps and args.schedule_steps > args.steps:
        overrides.append(f"training.exit_interval={args.steps}")
    if algo == "dflash":
        overrides += [f"draft.config.{k}={v}" for k, v in dflash_config(args).items()]
    log = open(out_dir.with_suffix(".log"), "a")
    return subprocess.Popen([sys.executable, "-m", "megatron_specdec.cli.train", "--config",
                             RECIPES[algo], *overrides], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)


def _checkpoint_steps(out_dir: Path) -> list:
    from megatron_specdec.training import checkpoints

    return sorted(map(checkpoints.step_of, checkpoints.checkpoints_in(out_dir / "checkpoints")))


def _finished(out_dir: Path, steps: int) -> bool:
    return (out_dir / "final").is_dir() and steps in _checkpoint_steps(out_dir)


def curve(out_dir: Path) -> list:
    """The logged steps (a resumed run's repeated steps once, the last record kept)."""
    rows = {}
    for line in (out_dir / "train_log.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "accuracy" in r:
            rows[r["step"]] = {"step": r["step"], "loss": r["loss"], "accuracy": r["accuracy"],
                               "implied_al": implied_al(r["accuracy"])}
    return [rows[step] for step in sorted(rows)]


def held_out_prompts(path: Path, n: int) -> Path:
    """n GSM8K training questions far past the ones the committed data answers (its first
    4,080) and the first n of the task split held out from training
    (data/smollm2_tasks_heldout.jsonl: code, extraction, passage QA, long summaries,
    translation in turn): prompts neither draft trained on; never MT-bench."""
    gsm8k = (REPO / "data/sources/gsm8k_train.jsonl").read_text().splitlines()[7000:7000 + n]
    tasks = (REPO / "data/smollm2_tasks_heldout.jsonl").read_text().splitlines()[:n]
    rows = [{"prompt": json.loads(r)["question"], "category": "gsm8k"} for r in gsm8k]
    rows += [{"prompt": t["prompt"], "category": t["category"]} for t in map(json.loads, tasks)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def measure(ckpt: str, prompts: str, out: str, max_new_tokens: int):
    """Greedy acceptance length of a speculative checkpoint (chain of 7, fixed), in this
    process."""
    from megatron_specdec.evaluation.acceptance import evaluate_acceptance

    report = evaluate_acceptance(ckpt, prompts, max_new_tokens=max_new_tokens,
                                 num_draft_tokens=7, policy="fixed", progress=False)
    report.pop("per_prompt", None)
    Path(out).write_text(json.dumps(report, indent=1, default=str) + "\n")


def _tool(*argv):
    subprocess.run([sys.executable, *argv], cwd=REPO, check=True)


def measured(work: Path, algo: str, step: int, args) -> dict:
    """The measured acceptance of `algo`'s checkpoint at `step` (kept in
    work/<algo>_acceptance_<step>.json; a rerun reads it back)."""
    out = work / f"{algo}_acceptance_{step:07d}.json"
    if not out.is_file():
        run = work / algo
        spec = run / "final"
        if step != json.loads((run / "summary.json").read_text())["steps"]:
            # the checkpoint's draft on the final checkpoint's base
            from megatron_specdec.training import checkpoints

            hf, spec = work / "exports" / f"{algo}_{step}", work / "exports" / f"{algo}_{step}_spec"
            _tool("checkpoint_tools/export_draft.py", "--model",
                  str(checkpoints.step_dir(run / "checkpoints", step)), "--out", str(hf),
                  "--overwrite")
            _tool("checkpoint_tools/import_draft.py", "--method", algo, "--draft", str(hf),
                  "--model", str(run / "final"), "--out", str(spec), "--overwrite")
        prompts = held_out_prompts(work / "held_out_prompts.jsonl", args.al_prompts)
        _tool(__file__, "--measure", str(spec), str(prompts), str(out), "--al-new-tokens",
              str(args.al_new_tokens))
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

    from megatron_specdec.evaluation.plots import save_figure

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for algo, rows in result["curves"].items():
        tokens = [r["step"] * result["tokens_per_step"] / 1e6 for r in rows]
        line, = ax[0].plot(tokens, [r["implied_al"] for r in rows], ":", alpha=0.6,
                           label=f"{algo}, implied by training accuracies")
        points = (result["measured_acceptance"] or {}).get(algo, {})
        steps = sorted(int(s) for s in points)
        ax[0].plot([s * result["tokens_per_step"] / 1e6 for s in steps],
                   [points[str(s)]["overall"]["acceptance_length"] for s in steps], "o-",
                   color=line.get_color(), label=f"{algo}, measured (held-out prompts)")
        ax[1].plot(tokens, [r["accuracy"][0] for r in rows], label=algo)
    ax[0].set(xlabel="training input tokens (M)", ylabel="acceptance length, chain of 7")
    ax[1].set(xlabel="training input tokens (M)", ylabel="top-1 accuracy, draft position 1")
    for a in ax:
        a.legend(fontsize=7)
    fig.suptitle(f"from scratch, same data; {result['cpu']} @ {result['commit']}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30, help="the step the curves end at")
    p.add_argument("--schedule-steps", type=int,
                   help="training.steps, the lr schedule's length (default: --steps); longer "
                        "stops the runs at --steps (training.exit_interval)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--global-batch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--checkpoint-interval", type=int, default=0,
                   help="steps between checkpoints, each measured (0: only --steps)")
    p.add_argument("--dflash-config", nargs="*", default=[], metavar="KEY=VALUE",
                   help="draft.config overrides of the DFlash run (e.g. num_layers=3 "
                        "k_norm_trainable=false)")
    p.add_argument("--work-dir", default="runs/bench_block_drafter")
    p.add_argument("--name", default=RESULT, help="bench/results/NAME.json and .png")
    p.add_argument("--window", type=int, default=5, help="steps averaged for the final figures")
    p.add_argument("--commit", help="the commit to record (default: this checkout's HEAD; a "
                                    "copied tree run away from a moving checkout names it)")
    p.add_argument("--al-prompts", type=int, default=4,
                   help="held-out GSM8K prompts, and as many held-out task prompts, for the "
                        "measured acceptance length (0: none)")
    p.add_argument("--al-new-tokens", type=int, default=48)
    p.add_argument("--measure-steps", type=int, nargs="*",
                   help="the checkpoints measured (default: every --checkpoint-interval)")
    p.add_argument("--curves-only", action="store_true",
                   help="write the JSON and plot from the runs' logs up to --steps as they "
                        "stand: no training, no measured acceptance")
    p.add_argument("--measure", nargs=3, metavar=("CKPT", "PROMPTS", "OUT"),
                   help=argparse.SUPPRESS)  # one checkpoint's acceptance, in a fresh process
    p.add_argument("--round-cost", action="store_true",
                   help="only measure a k=7 round's cost against a plain step "
                        "(bench/results/block_drafter_round_cost.json)")
    args = p.parse_args()
    for kv in args.dflash_config:
        if "=" not in kv:
            p.error(f"--dflash-config: expected KEY=VALUE, got {kv!r}")
    if args.round_cost:
        return round_cost(REPO / "bench/results/block_drafter_round_cost.json", 32, 3)
    if args.measure:
        return measure(*args.measure, args.al_new_tokens)
    work = REPO / args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    load_before, started = os.getloadavg(), time.time()
    # one after the other: two runs side by side halve a CPU's throughput
    for algo in () if args.curves_only else RECIPES:
        if not _finished(work / algo, args.steps) and train(algo, work / algo, args).wait():
            raise SystemExit(f"{algo} training failed: see {work / algo}.log")
    curves = {algo: [r for r in curve(work / algo) if r["step"] <= args.steps]
              for algo in RECIPES}
    final = {algo: {k: sum(r[k] for r in rows[-args.window:]) / len(rows[-args.window:])
                    for k in ("loss", "implied_al")} for algo, rows in curves.items()}
    acceptance = None
    if args.al_prompts and not args.curves_only:
        every = args.checkpoint_interval or args.steps  # not a SIGTERM's checkpoint between
        wanted = set(args.measure_steps or range(every, args.steps + 1, every))
        acceptance = {algo: {str(step): measured(work, algo, step, args)
                             for step in _checkpoint_steps(work / algo) if step in wanted}
                      for algo in RECIPES}
    result = {
        "what": "DFlash vs EAGLE3 drafts trained from scratch on the same data, equal input tokens",
        "cpu": cpu_model(), "commit": args.commit or commit(), "seconds": time.time() - started,
        "load_average_before_after": [load_before, os.getloadavg()],
        "steps": args.steps, "schedule_steps": args.schedule_steps or args.steps,
        "seq_length": args.seq_length,
        "dflash_anchors_per_sequence": int(dflash_config(args)["anchors_per_sequence"]),
        "global_batch_size": args.global_batch_size, "dflash_config": args.dflash_config,
        "tokens_per_step": args.seq_length * args.global_batch_size,
        "final_mean_of_last_steps": final,
        "implied_al_ratio_dflash_over_eagle3": final["dflash"]["implied_al"] / final["eagle3"]["implied_al"],
        "curves": curves,
        "measured_acceptance": acceptance,
    }
    if acceptance:
        last = {algo: acceptance[algo][str(args.steps)]["overall"]["acceptance_length"]
                for algo in RECIPES}
        result["measured_al_ratio_dflash_over_eagle3"] = last["dflash"] / last["eagle3"]
    out = REPO / "bench" / "results" / f"{args.name}.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result.get(k) for k in (
        "cpu", "commit", "final_mean_of_last_steps", "implied_al_ratio_dflash_over_eagle3",
        "measured_al_ratio_dflash_over_eagle3")}, indent=1))


if __name__ == "__main__":
    main()

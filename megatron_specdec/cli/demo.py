"""`make demo`: the whole pipeline on the embedded SmolLM2-135M-Instruct, with a small budget.

1. import the HF model into a Megatron dist checkpoint (checkpoint_tools/hf_to_megatron.py);
2. regenerate a slice of training data with that checkpoint (python -m megatron_specdec.cli.data);
3. add an EAGLE3 draft, its vocabulary calibrated on the data (convert_speculative.py);
4. train the draft with the shipped recipe, base frozen (python -m megatron_specdec.cli.train);
5. measure acceptance length on MT-bench and check speculative == greedy output
   (python -m megatron_specdec.cli.validate);
6. export the draft in the HF layout that vLLM/SGLang/TRT-LLM load (export_draft.py);
7-8. import the draft shipped in models/ (trained with the full recipe, see its README.md) onto
   the base and measure it: speculative against plain tokens/s and against stock transformers
   `generate` on the same prompts, acceptance length, and speculative == greedy output.

Each step runs the same command a user would (printed before it runs; the tools' own log lines
are kept to warnings, so what shows is the commands, their progress bars and their results).
Steps 1-6 show the pipeline working with a small budget (a few dozen training steps); steps
7-8 show what a fully trained draft does. It ends with one table of both drafts' acceptance
length, tokens/s and speedup; the figures and step timings go to WORKDIR/demo.json. Outputs go
under --workdir (default runs/demo).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron_specdec.cli.common import ArgumentParser, run_cli

REPO = Path(__file__).resolve().parents[2]
COMMITTED_DATA = REPO / "data" / "smollm2_regen.jsonl.gz"
SHIPPED_DRAFT = REPO / "models" / "eagle3_smollm2"
SHIPPED_PROMPTS = REPO / "bench" / "mt_bench_3per_category.jsonl"
STEPS = 8
DRAFT_VOCAB = 4096  # the demo's draft vocabulary: convert builds it, the recipe is told so


class StepFailed(Exception):
    pass


def _shown(arg) -> str:
    """An argument as printed: paths inside the repository relative to it (the commands run
    there), so the printed command is short and runs as written."""
    text = str(arg)
    if isinstance(arg, Path) and arg.is_relative_to(REPO):
        return str(arg.relative_to(REPO))
    return text


def _run(number: int, title: str, args: list, timings: dict):
    print(f"\n[{number}/{STEPS}] {title}\n$ python {' '.join(_shown(a) for a in args)}",
          flush=True)
    start = time.time()
    # The tools log at WARNING here: INFO lines would bury the commands and the results.
    env = dict(os.environ, SPECDEC_LOG_LEVEL=os.environ.get("SPECDEC_LOG_LEVEL", "WARNING"))
    code = subprocess.run([sys.executable, *(_shown(a) for a in args)], cwd=REPO,
                          env=env).returncode
    if code != 0:
        raise StepFailed(f"step {number}/{STEPS} ({title}) failed with exit code {code}; its "
                         f"command is printed above")
    timings[number] = round(time.time() - start, 1)
    print(f"    ({timings[number]:.0f} s)", flush=True)


def summary_table(rows) -> str:
    """One line per draft: prompts x tokens, acceptance length, tokens drafted a round,
    speculative and plain tokens/s, speedup, outputs identical to greedy; then transformers
    `generate` where it was timed beside them."""
    header = (f"{'draft':<26}{'prompts':>8}{'tokens':>7}{'AL':>6}{'drafted':>8}"
              f"{'spec tok/s':>11}{'plain tok/s':>12}{'speedup':>8}{'identical':>10}")
    lines = [header, "-" * len(header)]
    for name, r in rows:
        lines.append(f"{name:<26}{r['num_prompts']:>8}{r['max_new_tokens']:>7}"
                     f"{r['overall']['acceptance_length']:>6.2f}"
                     f"{r['overall']['mean_drafted']:>8.2f}"
                     f"{r['speculative_tokens_per_s']:>11.1f}{r['greedy_tokens_per_s']:>12.1f}"
                     f"{r['speedup']:>7.2f}x{r['identical_to_greedy']:>10}")
    for name, r in rows:
        if "transformers_tokens_per_s" in r:
            theirs = r["transformers_tokens_per_s"]
            lines.append(f"\n{name} against stock transformers generate (greedy, batch 1, "
                         f"{theirs:.1f} tokens/s on the same prompts):\n  speculative "
                         f"{r['speedup_vs_transformers']:.2f}x, plain greedy "
                         f"{r['greedy_tokens_per_s'] / theirs:.2f}x; transformers gave the same "
                         f"tokens on {r['identical_to_transformers']} prompts")
    return "\n".join(lines)


def build_parser():
    p = ArgumentParser(description=__doc__)
    p.add_argument("--workdir", default="runs/demo", help="where everything is written "
                   "(removed first: a rerun starts clean)")
    p.add_argument("--data-dir", default=str(REPO / "data" / "sources"),
                   help="prompt sources and mt_bench.jsonl (default: data/sources)")
    p.add_argument("--regen-prompts", type=int, default=16, help="prompts answered in step 2")
    p.add_argument("--train-steps", type=int, default=30, help="training steps in step 4")
    p.add_argument("--eval-prompts", type=int, default=4, help="MT-bench prompts in step 5")
    p.add_argument("--shipped-prompts", type=int, default=8,
                   help="MT-bench prompts (3 per category, in order) in step 8")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        demo(args)
    except StepFailed as e:
        raise SystemExit(f"error: {e}") from None


def demo(args):
    began = time.time()
    work = (REPO / args.workdir).resolve()
    if work.exists():
        shutil.rmtree(work)  # the demo owns its workdir: a rerun starts clean
    data_dir = Path(args.data_dir).resolve()
    base, regen = work / "smollm2_base", work / "data" / "regen.jsonl"
    draft, train, hf_draft = work / "smollm2_eagle3_init", work / "train", work / "hf_eagle3"
    shipped, shipped_report = work / "smollm2_shipped_eagle3", work / "shipped_acceptance"
    timings = {}
    print(f"make demo: the whole pipeline on SmolLM2-135M-Instruct, outputs in {_shown(work)}")

    _run(1, "import SmolLM2-135M-Instruct into a Megatron checkpoint (TP=1)",
         ["checkpoint_tools/hf_to_megatron.py", "--model", "default", "--out", base], timings)
    committed = [COMMITTED_DATA] if COMMITTED_DATA.is_file() else []
    # New prompts beside the committed data, not those it already answers.
    _run(2, "regenerate a slice of training data with it",
         ["-m", "megatron_specdec.cli.data", "regenerate", "--data-dir", data_dir, "--backend",
          "megatron", "--model", base, "--limit", args.regen_prompts, "--batch-size",
          args.regen_prompts, "--max-new-tokens", 96, "--out", regen]
         + (["--exclude", *committed] if committed else []), timings)
    train_data = [regen, *committed]
    _run(3, "add an EAGLE3 draft (draft vocabulary calibrated on the data)",
         ["checkpoint_tools/convert_speculative.py", "--model", base, "--algo", "eagle3",
          "--out", draft, "--draft-vocab-size", DRAFT_VOCAB, "--calibration-data", *train_data],
         timings)
    _run(4, f"train the draft ({args.train_steps} steps, base frozen)",
         ["-m", "megatron_specdec.cli.train", "--config", "recipes/eagle3_smollm2.yaml",
          f"output_dir={_shown(train)}", f"model.path={_shown(draft)}",
          f"draft.config.draft_vocab_size={DRAFT_VOCAB}",
          f"data.train=[{','.join(_shown(d) for d in train_data)}]", "data.seq_length=256",
          f"training.steps={args.train_steps}", "training.global_batch_size=2",
          "optimizer.warmup_steps=5", "checkpointing.interval=10", "evaluation.interval=0",
          "logging.interval=5"], timings)
    _run(5, "acceptance length on MT-bench, speculative == greedy",
         ["-m", "megatron_specdec.cli.validate", "--model", train / "final",
          "--data", data_dir / "mt_bench.jsonl", "--out", work / "acceptance",
          "--num-prompts", args.eval_prompts, "--max-new-tokens", 48], timings)
    _run(6, "export the draft for vLLM / SGLang / TRT-LLM",
         ["checkpoint_tools/export_draft.py", "--model", train / "final", "--out", hf_draft],
         timings)
    _run(7, "import the shipped draft (models/eagle3_smollm2) onto the base",
         ["checkpoint_tools/import_draft.py", "--draft", SHIPPED_DRAFT, "--model", base,
          "--out", shipped], timings)
    _run(8, "speculative vs plain generation with the shipped draft, and stock transformers",
         ["-m", "megatron_specdec.cli.validate", "--model", shipped,
          "--data", SHIPPED_PROMPTS, "--out", shipped_report,
          "--num-prompts", args.shipped_prompts, "--max-new-tokens", 128, "--transformers"],
         timings)

    ours = json.loads((work / "acceptance" / "acceptance.json").read_text())
    ship = json.loads((shipped_report / "acceptance.json").read_text())
    rows = [(f"{args.train_steps}-step draft (steps 1-6)", ours),
            ("shipped draft (steps 7-8)", ship)]
    total = time.time() - began
    record = {
        "seconds": {"total": round(total, 1), **{f"step{n}": t for n, t in timings.items()}},
        "drafts": {name: {k: v for k, v in r.items() if k != "per_prompt"} for name, r in rows},
        "outputs": {"base": str(base), "data": str(regen), "draft_init": str(draft),
                    "training": str(train), "trained_draft": str(train / "final"),
                    "hf_export": str(hf_draft), "shipped_on_base": str(shipped)},
    }
    (work / "demo.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"\n== make demo finished in {total / 60:.1f} min "
          f"(steps: {', '.join(f'{n}: {t:.0f} s' for n, t in timings.items())})\n")
    print(summary_table(rows))
    print("\nAL: tokens per verify forward (1.0 = no gain); drafted: tokens drafted a round (the "
          "adaptive policy drafts only where the draft has been paying)")
    print(f"trained draft {_shown(train / 'final')}, its HF export {_shown(hf_draft)}; "
          f"figures and timings: {_shown(work / 'demo.json')}")
    for name, r in rows:
        identical, compared = r["identical_to_greedy"].split("/")
        if identical != compared:
            raise StepFailed(f"{name}: speculative output differs from greedy output "
                             f"({r['identical_to_greedy']} identical)")


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())

"""`make demo`: the whole pipeline on the embedded SmolLM2-135M-Instruct, with a small budget.

1. import the HF model into a Megatron dist checkpoint (checkpoint_tools/hf_to_megatron.py);
2. regenerate a slice of training data with that checkpoint (python -m megatron_specdec.data);
3. add an EAGLE3 draft, its vocabulary calibrated on the data (convert_speculative.py);
4. train the draft with the shipped recipe, base frozen (python -m megatron_specdec.train);
5. measure acceptance length on MT-bench and check speculative == greedy output
   (python -m megatron_specdec.decoding.validate);
6. export the draft in the HF layout that vLLM/SGLang/TRT-LLM load (export_draft.py);
7-8. import the draft shipped in models/ (trained with the full recipe, see its README.md) onto
   the base and measure it: speculative against plain tokens/s, acceptance length, and
   speculative == greedy output.

Each step runs the same command a user would (printed before it runs). Steps 1-6 show the
pipeline working with a small budget (a few dozen training steps); steps 7-8 show what a fully
trained draft does. Outputs go under --workdir (default runs/demo).
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron_specdec.cli import run_cli

REPO = Path(__file__).resolve().parent.parent
COMMITTED_DATA = REPO / "data" / "smollm2_regen.jsonl.gz"
SHIPPED_DRAFT = REPO / "models" / "eagle3_smollm2"
SHIPPED_PROMPTS = REPO / "bench" / "mt_bench_3per_category.jsonl"


def _run(title: str, args: list, timings: dict):
    cmd = [sys.executable, *args]
    print(f"\n=== {title}\n$ python {' '.join(str(a) for a in args)}", flush=True)
    start = time.time()
    subprocess.run([str(c) for c in cmd], check=True, cwd=REPO)
    timings[title] = round(time.time() - start, 1)
    print(f"=== {title}: {timings[title]} s", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="runs/demo")
    p.add_argument("--data-dir", default=str(REPO / "data" / "sources"),
                   help="prompt sources and mt_bench.jsonl (default: data/sources)")
    p.add_argument("--regen-prompts", type=int, default=16, help="prompts answered in step 2")
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--eval-prompts", type=int, default=4, help="MT-bench prompts in step 5")
    p.add_argument("--shipped-prompts", type=int, default=8,
                   help="MT-bench prompts (3 per category, in order) in step 7")
    args = p.parse_args(argv)

    work = (REPO / args.workdir).resolve()
    if work.exists():
        shutil.rmtree(work)  # the demo owns its workdir: a rerun starts clean
    data_dir = Path(args.data_dir).resolve()
    base, regen = work / "smollm2_base", work / "data" / "regen.jsonl"
    draft, train, hf_draft = work / "smollm2_eagle3_init", work / "train", work / "hf_eagle3"
    timings = {}

    _run("1/8 import SmolLM2-135M-Instruct (TP=1)",
         ["checkpoint_tools/hf_to_megatron.py", "--hf_path", "default", "--out", base], timings)
    _run("2/8 regenerate a slice of training data",
         ["-m", "megatron_specdec.data", "regenerate", "--data-dir", data_dir, "--backend", "megatron",
          "--checkpoint", base, "--limit", args.regen_prompts, "--batch-size", args.regen_prompts,
          "--max-new-tokens", 96, "--out", regen], timings)
    train_data = [regen, COMMITTED_DATA] if COMMITTED_DATA.is_file() else [regen]
    _run("3/8 add an EAGLE3 draft (calibrated draft vocabulary)",
         ["checkpoint_tools/convert_speculative.py", "--model_path", base, "--specdec_algo", "eagle3",
          "--export_dir", draft, "--draft_vocab_size", 4096, "--calibration_data", *train_data],
         timings)
    _run(f"4/8 train the draft ({args.train_steps} steps, base frozen)",
         ["-m", "megatron_specdec.train", "--config", "recipes/eagle3_smollm2.yaml",
          f"output_dir={train}", f"model.path={draft}",
          f"data.train=[{','.join(str(d) for d in train_data)}]", "data.seq_length=256",
          f"training.steps={args.train_steps}", "training.global_batch_size=2",
          "optimizer.warmup_steps=5", "checkpointing.interval=10", "evaluation.interval=0",
          "logging.interval=5"], timings)
    _run("5/8 acceptance length on MT-bench",
         ["-m", "megatron_specdec.decoding.validate", "--model", train / "final",
          "--data", data_dir / "mt_bench.jsonl", "--out-dir", work / "acceptance",
          "--num-prompts", args.eval_prompts, "--max-new-tokens", 48], timings)
    _run("6/8 export the draft for vLLM / SGLang / TRT-LLM",
         ["checkpoint_tools/export_draft.py", "--ckpt", train / "final", "--out", hf_draft], timings)

    shipped, shipped_report = work / "smollm2_shipped_eagle3", work / "shipped_acceptance"
    _run("7/8 import the shipped draft (models/eagle3_smollm2) onto the base",
         ["checkpoint_tools/import_draft.py", "--draft", SHIPPED_DRAFT, "--model_path", base,
          "--export_dir", shipped], timings)
    _run("8/8 speculative vs plain generation with the shipped draft",
         ["-m", "megatron_specdec.decoding.validate", "--model", shipped,
          "--data", SHIPPED_PROMPTS, "--out-dir", shipped_report,
          "--num-prompts", args.shipped_prompts, "--max-new-tokens", 128], timings)

    report = json.loads((work / "acceptance" / "acceptance.json").read_text())
    ship = json.loads((shipped_report / "acceptance.json").read_text())
    print("\n=== demo finished")
    print(f"base checkpoint        {base}")
    print(f"regenerated data       {regen}")
    print(f"draft before training  {draft}")
    print(f"training run           {train} (summary.json, tensorboard/, checkpoints)")
    print(f"trained draft          {train / 'final'}")
    print(f"acceptance report      {work / 'acceptance'} (acceptance.json, acceptance.png)")
    print(f"HF export              {hf_draft}")
    print(f"shipped draft on base  {shipped} (report: {shipped_report})")
    print(f"\n{args.train_steps}-step draft: acceptance length "
          f"{report['overall']['acceptance_length']:.2f} over {report['num_prompts']} prompts; "
          f"speculative output identical to greedy: {report['identical_to_greedy']}")
    print(f"shipped draft:      acceptance length {ship['overall']['acceptance_length']:.2f} over "
          f"{ship['num_prompts']} MT-bench prompts x {ship['max_new_tokens']} tokens; speculative "
          f"{ship['speculative_tokens_per_s']:.1f} tokens/s vs plain greedy "
          f"{ship['greedy_tokens_per_s']:.1f} ({ship['speedup']:.2f}x); identical to greedy: "
          f"{ship['identical_to_greedy']}")
    print(f"                    ({ship['draft_policy']} draft length: "
          f"{ship['overall']['mean_drafted']:.2f} tokens drafted a round on average; the policy "
          f"drafts only where the draft has been paying)")
    print("seconds: " + ", ".join(f"step {k.split(' ', 1)[0]} {v}" for k, v in timings.items()))
    for r in (report, ship):
        identical, compared = r["identical_to_greedy"].split("/")
        if identical != compared:
            raise SystemExit("speculative output differs from greedy output")


if __name__ == "__main__":
    sys.exit(run_cli(main))

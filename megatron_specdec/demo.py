"""`make demo`: the whole pipeline on the embedded SmolLM2-135M-Instruct, with a small budget.

1. import the HF model into a Megatron dist checkpoint (checkpoint_tools/hf_to_megatron.py);
2. regenerate a slice of training data with that checkpoint (python -m megatron_specdec.data);
3. add an EAGLE3 draft, its vocabulary calibrated on the data (convert_speculative.py);
4. train the draft with the shipped recipe, base frozen (python -m megatron_specdec.train);
5. measure acceptance length on MT-bench and check speculative == greedy output
   (python -m megatron_specdec.decoding.validate);
6. export the draft in the HF layout that vLLM/SGLang/TRT-LLM load (export_draft.py).

Each step runs the same command a user would (printed before it runs). The budget (a few
dozen training steps) only shows the pipeline working; the trained draft of the README comes
from the full recipe. Outputs go under --workdir (default runs/demo).
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
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"),
                   help="prompt sources and mt_bench.jsonl (default: ../shared/data)")
    p.add_argument("--regen-prompts", type=int, default=16, help="prompts answered in step 2")
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--eval-prompts", type=int, default=4, help="MT-bench prompts in step 5")
    args = p.parse_args(argv)

    work = (REPO / args.workdir).resolve()
    if work.exists():
        shutil.rmtree(work)  # the demo owns its workdir: a rerun starts clean
    data_dir = Path(args.data_dir).resolve()
    base, regen = work / "smollm2_base", work / "data" / "regen.jsonl"
    draft, train, hf_draft = work / "smollm2_eagle3_init", work / "train", work / "hf_eagle3"
    timings = {}

    _run("1/6 import SmolLM2-135M-Instruct (TP=1)",
         ["checkpoint_tools/hf_to_megatron.py", "--hf_path", "default", "--out", base], timings)
    _run("2/6 regenerate a slice of training data",
         ["-m", "megatron_specdec.data", "regenerate", "--data-dir", data_dir, "--backend", "megatron",
          "--checkpoint", base, "--limit", args.regen_prompts, "--batch-size", args.regen_prompts,
          "--max-new-tokens", 96, "--out", regen], timings)
    train_data = [regen, COMMITTED_DATA] if COMMITTED_DATA.is_file() else [regen]
    _run("3/6 add an EAGLE3 draft (calibrated draft vocabulary)",
         ["checkpoint_tools/convert_speculative.py", "--model_path", base, "--specdec_algo", "eagle3",
          "--export_dir", draft, "--draft_vocab_size", 4096, "--calibration_data", *train_data],
         timings)
    _run(f"4/6 train the draft ({args.train_steps} steps, base frozen)",
         ["-m", "megatron_specdec.train", "--config", "recipes/eagle3_smollm2.yaml",
          f"output_dir={train}", f"model.path={draft}",
          f"data.train=[{','.join(str(d) for d in train_data)}]", "data.seq_length=256",
          f"training.steps={args.train_steps}", "training.global_batch_size=2",
          "optimizer.warmup_steps=5", "checkpointing.interval=10", "evaluation.interval=0",
          "logging.interval=5"], timings)
    _run("5/6 acceptance length on MT-bench",
         ["-m", "megatron_specdec.decoding.validate", "--model", train / "final",
          "--data", data_dir / "mt_bench.jsonl", "--out-dir", work / "acceptance",
          "--num-prompts", args.eval_prompts, "--max-new-tokens", 48], timings)
    _run("6/6 export the draft for vLLM / SGLang / TRT-LLM",
         ["checkpoint_tools/export_draft.py", "--ckpt", train / "final", "--out", hf_draft], timings)

    report = json.loads((work / "acceptance" / "acceptance.json").read_text())
    print("\n=== demo finished")
    print(f"base checkpoint        {base}")
    print(f"regenerated data       {regen}")
    print(f"draft before training  {draft}")
    print(f"training run           {train} (summary.json, tensorboard/, checkpoints)")
    print(f"trained draft          {train / 'final'}")
    print(f"acceptance report      {work / 'acceptance'} (acceptance.json, acceptance.png)")
    print(f"HF export              {hf_draft}")
    print(f"acceptance length {report['overall']['acceptance_length']:.2f} over {report['num_prompts']} prompts "
          f"(a {args.train_steps}-step draft; the README's comes from the full recipe); speculative "
          f"output identical to greedy: {report['identical_to_greedy']}")
    print("seconds: " + ", ".join(f"step {k.split(' ', 1)[0]} {v}" for k, v in timings.items()))
    identical, compared = report["identical_to_greedy"].split("/")
    if identical != compared:
        raise SystemExit("speculative output differs from greedy output")


if __name__ == "__main__":
    sys.exit(run_cli(main))

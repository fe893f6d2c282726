"""`make demo`: the main job on the embedded SmolLM2-135M-Instruct, end to end on this machine.

1. Import the model into Megatron dist checkpoints at TP=1 and at TP=2.
2. Answer a chat prompt by greedy generation from each (TP=2 under torchrun, 2 processes),
   and check that both layouts give the same answer.
Outputs go under --workdir (default runs/demo).
"""

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_specdec.cli import run_cli

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many " \
         "clips in May. How many clips did Natalia sell altogether in April and May?"

log = logging.getLogger("demo")


def _torchrun_chat(ckpt, tp, max_new_tokens):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
           "-m", "megatron_specdec.chat", "--model", str(ckpt), "--tp", str(tp),
           "--prompt", PROMPT, "--max_new_tokens", str(max_new_tokens)]
    log.info("$ %s", " ".join(cmd[2:]))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // tp)))
    result = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    print(result.stdout, flush=True)
    return result.stdout.split(f">>> {PROMPT}\n", 1)[1].rsplit("\n[", 1)[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="runs/demo")
    p.add_argument("--max_new_tokens", type=int, default=96)
    args = p.parse_args(argv)

    from megatron_specdec.hf_conversion import hf_to_megatron

    work = Path(args.workdir)
    answers = {}
    for tp in (1, 2):
        ckpt = work / f"smollm2_tp{tp}"
        start = time.time()
        hf_to_megatron("default", ckpt, tp=tp, overwrite=True)
        log.info("imported SmolLM2-135M-Instruct at TP=%d into %s (%.1f s)", tp, ckpt,
                 time.time() - start)
        answers[tp] = _torchrun_chat(ckpt, tp, args.max_new_tokens)
    same = answers[1] == answers[2]
    print(f"TP=1 and TP=2 answers identical: {same}")
    print(f"checkpoints: {work / 'smollm2_tp1'}, {work / 'smollm2_tp2'}")
    if not same:
        raise SystemExit("TP=1 and TP=2 greedy answers differ")


if __name__ == "__main__":
    sys.exit(run_cli(main))

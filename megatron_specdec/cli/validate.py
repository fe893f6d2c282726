"""Acceptance-length validation of a speculative model over a jsonl of chat prompts.

    python -m megatron_specdec.cli.validate --model CKPT \\
        --data data/sources/mt_bench.jsonl --out runs/validate \\
        [--num-prompts 8] [--max-new-tokens 128] [--num-draft-tokens 7] [--tp 2] [--pp 1]
        [--tree-top-k 4 [--tree-max-nodes 32]]
        [--drafter eagle3|medusa|ngram|draft_model [--draft-model DRAFT_CKPT]]
        [--draft-policy adaptive|fixed] [--temperature 0.7 [--top-k 50] [--top-p 0.9] [--seed 0]]
        [--acceptance typical [--typical-eps 0.09] [--typical-alpha 0.3]] [--batch-size 4]
        [--transformers [HF_DIR]]

Each line is a question: the first of its `turns` (MT-bench; or its `prompt`, or the first
user message of a training row's `conversations`) goes through the tokenizer's chat template as
one user message; later turns are not used (a multi-turn evaluation would need the model's own
earlier answers in the context). `category` (else `source`) groups the report. A `.gz` file is
read decompressed, so a data file kept out of training is a validation split as it stands
(`--data data/smollm2_regen_steered11.jsonl.gz --num-prompts 40`). Speculative generation runs
--batch-size prompts at a time (default 1; rows accept ragged counts); plain generation of
the same base on the same batches gives the tokens/s baseline of the same runtime and checks
that both produce the same tokens; --transformers also times stock transformers `generate` on
the base (what a user would run instead) and counts the prompts where it gives the same tokens.
Prints a short table (acceptance length, per-position acceptance, tokens/s, identity) and writes
the full report to OUT/acceptance.json and its plot to OUT/acceptance.png (acceptance rate per
draft position, overall and per category). With --tree-top-k the drafts form a tree of depth
--num-draft-tokens (inference/tree.py); acceptance length is counted the same way (tokens per
verify forward), and "draft position" is the depth along the accepted path. With --tp/--pp > 1
and no torchrun environment, the ranks are spawned locally.
"""

import os
import sys
from pathlib import Path

from megatron_specdec.cli.common import ArgumentParser, run_cli
from megatron_specdec.evaluation.acceptance import (check_batch_size,
                                                    check_transformers_baseline,
                                                    evaluate_acceptance, format_report)
from megatron_specdec.evaluation.transformers_baseline import hf_base_dir


def build_parser():
    p = ArgumentParser(description=__doc__, renamed={"--out-dir": "--out"})
    p.add_argument("--model", required=True, help="speculative checkpoint directory")
    p.add_argument("--data", required=True, help="jsonl of prompts, e.g. MT-bench")
    p.add_argument("--out", required=True,
                   help="directory to write: acceptance.json (the full report), acceptance.png")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts only")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per prompt (fewer at an end of turn)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="chain length k, or tree depth (default: EAGLE3 ttt_steps, Medusa heads)")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="draft a tree with this branching (EAGLE-2 style) instead of a chain")
    p.add_argument("--tree-max-nodes", type=int, default=None,
                   help="keep this many tree nodes of highest draft probability (default: all)")
    add_drafting_args(p)
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts generated together (rows accept ragged counts)")
    p.add_argument("--no-greedy", action="store_true", help="skip the plain greedy baseline")
    p.add_argument("--transformers", nargs="?", const="", default=None, metavar="HF_DIR",
                   help="also time stock transformers generate (greedy, batch 1) on the same "
                        "prompts: the base in HF_DIR, or bare, the HF directory the checkpoint's "
                        "base was converted from")
    p.add_argument("--prompt-bucket", type=int, default=None,
                   help="a batch's prompts are left-padded to a multiple of this many tokens, "
                        "so a long run meets few prefill shapes (bf16 keeps a kernel per shape; "
                        "default: generation.PROMPT_BUCKET)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    return p


def add_drafting_args(p):
    """--drafter and --draft-policy, shared with bench/bench_generation.py."""
    from megatron_specdec.inference.draft_policy import POLICIES
    from megatron_specdec.inference.generator import drafters
    from megatron_specdec.inference.sampling import ACCEPTANCE, TypicalAcceptance

    p.add_argument("--drafter", choices=drafters(), default=None,
                   help="who drafts (default: the checkpoint's draft module; ngram needs none)")
    p.add_argument("--draft-model", default=None,
                   help="--drafter draft_model: a GPT checkpoint of the target's vocabulary")
    p.add_argument("--draft-policy", choices=POLICIES, default="adaptive",
                   help="adaptive: draft while the draft is confident (default); fixed: always k")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples losslessly (chains and trees)")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k likeliest (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass")
    p.add_argument("--seed", type=int, default=0, help="sampling: seed of the first prompt")
    p.add_argument("--acceptance", choices=ACCEPTANCE, default="rejection",
                   help="sampling: rejection (lossless, default) or typical (Medusa's typical "
                        "acceptance: lossy, Medusa chains only)")
    p.add_argument("--typical-eps", type=float, default=TypicalAcceptance.eps,
                   help="--acceptance typical: probability floor eps")
    p.add_argument("--typical-alpha", type=float, default=TypicalAcceptance.alpha,
                   help="--acceptance typical: entropy factor alpha")


def sampling_of(args):
    """The Sampling of --temperature/--top-k/--top-p/--seed (None: greedy)."""
    from megatron_specdec.inference.sampling import Sampling

    settings = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    return None if settings.greedy else settings


def typical_of(args):
    """The TypicalAcceptance of --acceptance typical and --typical-eps/--typical-alpha (None:
    rejection sampling); errors name the flag."""
    from megatron_specdec.inference.sampling import TypicalAcceptance

    if args.acceptance != "typical":
        if (args.typical_eps, args.typical_alpha) != (TypicalAcceptance.eps,
                                                      TypicalAcceptance.alpha):
            raise ValueError("--typical-eps/--typical-alpha need --acceptance typical")
        return None
    if args.temperature <= 0 or args.top_k or args.top_p < 1:
        raise ValueError("--acceptance typical needs --temperature > 0 and no --top-k/--top-p")
    return TypicalAcceptance(args.typical_eps, args.typical_alpha)


def check_draft_model_args(args, vocab_size: int, tokenizer_dir):
    """--draft-model goes with a --drafter that reads a draft checkpoint (draft_model), and
    its vocabulary is the target's (`vocab_size`, `tokenizer_dir`): checked before any rank
    starts."""
    from megatron_specdec import registry

    needs = args.drafter is not None and registry.get(args.drafter).needs_draft_checkpoint
    if needs != (args.draft_model is not None):
        raise ValueError("--drafter draft_model needs --draft-model PATH, and --draft-model "
                         "needs --drafter draft_model")
    if args.draft_model is not None:
        from megatron_specdec.methods.draft_model.proposer import check_draft_checkpoint

        check_draft_checkpoint(args.draft_model, vocab_size, tokenizer_dir)


def tree_spec(args):
    """The TreeSpec of --tree-top-k / --tree-max-nodes (None: chain drafting)."""
    from megatron_specdec.inference.tree import TreeSpec

    if args.tree_top_k is None:
        if args.tree_max_nodes is not None:
            raise ValueError("--tree-max-nodes needs --tree-top-k")
        return None
    return TreeSpec(args.tree_top_k, args.tree_max_nodes)


def _worker(args):
    from megatron_specdec import distributed
    from megatron_specdec.distributed import is_rank0

    distributed.initialize(args.tp, args.pp)
    report = evaluate_acceptance(args.model, args.data, max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=args.num_draft_tokens,
                                 num_prompts=args.num_prompts, out_dir=args.out,
                                 compare_greedy=not args.no_greedy, tree=tree_spec(args),
                                 drafter=args.drafter, policy=args.draft_policy,
                                 sampling=sampling_of(args), draft_model=args.draft_model,
                                 batch_size=args.batch_size, typical=typical_of(args),
                                 prompt_bucket=args.prompt_bucket,
                                 transformers=args.transformers)
    if is_rank0():
        print(format_report(report))
        print(f"full report: {Path(args.out) / 'acceptance.json'} (plot: acceptance.png)")


def main(argv=None):
    from megatron_specdec.checkpointing import checkpoint

    args = build_parser().parse_args(argv)
    if not Path(args.data).is_file():
        raise FileNotFoundError(f"prompt file {args.data} not found")
    meta = checkpoint.read_meta(args.model)  # a clear error here, before any rank starts
    check_draft_model_args(args, meta["hf_config"]["vocab_size"],
                           Path(args.model) / checkpoint.TOKENIZER_DIR)
    tree_spec(args)
    sampling = sampling_of(args)
    typical_of(args)
    check_batch_size(args.batch_size)
    if args.transformers is not None:
        check_transformers_baseline(args.batch_size, sampling, args.tp * args.pp)
        args.transformers = hf_base_dir(args.model, args.transformers or None)
    if args.tp * args.pp > 1 and "RANK" not in os.environ:
        from megatron_specdec import distributed

        distributed.spawn(_worker, args.tp * args.pp, args)
    else:
        _worker(args)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())

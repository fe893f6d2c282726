"""Speculative vs plain greedy generation in the same runtime, on MT-bench prompts.

For each prompt (first turn, chat template; batch 1) the same base generates up to
--max-new-tokens greedily, once speculatively (draft k, verify in one base forward, fused
greedy acceptance) and once plainly (generation.greedy_generate). Reports tokens/s of both,
the speedup, the acceptance length (tokens per verify forward, bonus included) and the
acceptance rate per draft position, and checks the two outputs are identical.

    python bench/bench_generation.py --data ../shared/data/mt_bench.jsonl [--num-prompts 8]
        [--model CKPT | --algo eagle3|medusa] [--num-draft-tokens K]
        [--tree-top-k T [--tree-max-nodes N]]

Without --model the draft is a randomly initialised one on the embedded SmolLM2 (what
`convert` gives before training): it accepts almost nothing, so this measures the overhead
of drafting and verifying, not the speedup a trained draft brings. A second pass feeds the
same loop drafts taken from the greedy output (an oracle at the same drafting cost): the
ceiling of the machinery in this runtime. With --tree-top-k both passes draft trees of depth
K (the oracle puts the greedy tokens on one late branch). Table on stdout, JSON in
bench/results/generation.json (the plot next to it).
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from megatron_specdec import distributed

RESULTS = Path(__file__).resolve().parent / "results" / "generation.json"


def build(args):
    """(speculative model, tokenizer directory, description) at TP=PP=1."""
    from megatron_specdec import checkpoint, convert
    from megatron_specdec.default_model import default_model_dir
    from megatron_specdec.hf_conversion import model_from_hf
    from megatron_specdec.speculative import load_speculative

    if args.model:
        model, _, _ = load_speculative(args.model)
        return model, Path(args.model) / checkpoint.TOKENIZER_DIR, f"checkpoint {args.model}"
    hf_dir = default_model_dir()
    base, config = model_from_hf(hf_dir)
    torch.manual_seed(0)
    model = convert(base, args.algo, {}, hf_config=config)
    return model, hf_dir, f"SmolLM2-135M-Instruct + random {args.algo} draft (untrained)"


def oracle_run(model, prompts, eos, max_new_tokens, k, tree=None):
    """The same loop with drafts taken from the base's greedy output (decoding/oracle.py):
    the ceiling of the draft-verify machinery at this draft's cost, not a draft's quality."""
    from megatron_specdec.decoding.generator import SpeculativeGenerator
    from megatron_specdec.decoding.metrics import acceptance_summary
    from megatron_specdec.decoding.oracle import OracleDrafter
    from megatron_specdec.generation import greedy_generate

    generator = SpeculativeGenerator(model, k, tree=tree)
    inner = generator.drafter
    tokens, seconds, accepted, identical = 0, 0.0, [], 0
    for _, ids in prompts:
        greedy = greedy_generate(model.base, [ids], max_new_tokens, model.vocab_size, eos)[0]
        generator.drafter = OracleDrafter(inner, greedy, vocab_size=model.vocab_size)
        start = time.perf_counter()
        result = generator.generate(ids, max_new_tokens, eos)
        seconds += time.perf_counter() - start
        tokens += len(result.tokens)
        accepted += result.accepted
        identical += result.tokens == greedy
    return {"tokens_per_s": tokens / seconds,
            "acceptance_length": acceptance_summary(accepted, generator.k)["acceptance_length"],
            "identical_to_greedy": f"{identical}/{len(prompts)}"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True,
                   help="MT-bench jsonl (e.g. ../shared/data/mt_bench.jsonl)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--model", default=None, help="speculative checkpoint (default: random draft)")
    p.add_argument("--algo", choices=("eagle3", "medusa"), default="eagle3")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="draft a tree with this branching instead of a chain")
    p.add_argument("--tree-max-nodes", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()

    from megatron_specdec.decoding.validate import evaluate_acceptance, tree_spec

    tree = tree_spec(args)
    distributed.initialize(1, 1)
    model, tokenizer_dir, what = build(args)
    load_before = os.getloadavg()[0]
    out = Path(args.out)
    report = evaluate_acceptance(model, args.data, tokenizer_dir,
                                 max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=args.num_draft_tokens,
                                 num_prompts=args.num_prompts, out_dir=None, tree=tree)
    from megatron_specdec.data import end_of_turn_ids, load_tokenizer
    from megatron_specdec.decoding.validate import read_prompts

    tokenizer = load_tokenizer(str(tokenizer_dir))
    oracle = oracle_run(model, read_prompts(args.data, tokenizer, args.num_prompts),
                        end_of_turn_ids(tokenizer), args.max_new_tokens,
                        report["num_draft_tokens"], tree)
    overall = report["overall"]
    result = {
        "model": what,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "layout": "TP=1 PP=1, batch 1, float32",
        "load_average_1min": [load_before, os.getloadavg()[0]],  # other work on the machine
        **{k: report[k] for k in ("algo", "num_draft_tokens", "tree", "max_new_tokens",
                                  "num_prompts",
                                  "prompts", "new_tokens", "speculative_tokens_per_s",
                                  "greedy_tokens_per_s", "speedup", "identical_to_greedy")},
        "acceptance_length": overall["acceptance_length"],
        "position_acceptance": overall["position_acceptance"],
        "categories": {c: s["acceptance_length"] for c, s in report["categories"].items()},
        "oracle_draft": oracle,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    from megatron_specdec.decoding.validate import plot_acceptance

    plot_acceptance(report, out.with_suffix(".png"))
    print(f"\n{what}; {report['num_prompts']} MT-bench prompts, up to "
          f"{args.max_new_tokens} new tokens, k={report['num_draft_tokens']}"
          + ("" if tree is None else f", tree {report['tree']}"))
    print(f"{'':24}{'tokens/s':>10}")
    print(f"{'plain greedy':24}{report['greedy_tokens_per_s']:>10.2f}")
    print(f"{'speculative greedy':24}{report['speculative_tokens_per_s']:>10.2f}"
          f"   acceptance length {overall['acceptance_length']:.3f}")
    print(f"{'  same, oracle drafts':24}{oracle['tokens_per_s']:>10.2f}"
          f"   acceptance length {oracle['acceptance_length']:.3f}")
    print(f"speedup {report['speedup']:.2f}x (oracle drafts "
          f"{oracle['tokens_per_s'] / report['greedy_tokens_per_s']:.2f}x), identical outputs "
          f"{report['identical_to_greedy']} (oracle {oracle['identical_to_greedy']})")
    print("acceptance per position: "
          + " ".join("-" if r is None else f"{r:.2f}" for r in overall["position_acceptance"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Greedy decoding with and without the greedy chain (inference/generation.py, GreedyChain:
a batch-1 greedy forward as the lookup, the decode_layers op, the final norm and the screened
head, without the general step's per-forward work), side by side in one process: plain greedy
and the default EAGLE3 mode of a speculative checkpoint on MT-bench prompts (every 10th
question's first turn, batch 1), each prompt run with SPECDEC_GREEDY_CHAIN=0 (every forward
through StageRunner's general step) and with the chain, in alternating order, `rounds` times.
Outputs must be identical between the two; the figures are tokens/s of each path over all
rounds and the median over rounds of the chain's speed over the general step's.

    python bench/bench_greedy_chain.py --model runs/base_shipped_eagle3 [--rounds 3] \
        [--num-prompts 8] [--max-new-tokens 128] [--out bench/results/greedy_chain.json]
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import describe_machine, read_bandwidth_gbs, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "greedy_chain.json"
PATHS = ("general", "chain")


def alternation_parser(doc: str, num_prompts: int, max_new_tokens: int, rounds: int,
                       model_help: str):
    """The flags of an in-process alternation bench, with these defaults (each adds --out)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", required=True, help=model_help)
    p.add_argument("--data", default="data/sources/mt_bench.jsonl")
    p.add_argument("--num-prompts", type=int, default=num_prompts,
                   help="every 10th question, this many")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--rounds", type=int, default=rounds)
    return p


def load_alternation(args):
    """What an in-process alternation bench runs on, its counts checked first: the speculative
    checkpoint `args.model` (eval mode, one process), every 10th MT-bench question's first turn
    (`args.num_prompts` of them, as token ids) and the end-of-turn ids."""
    for flag in ("num_prompts", "max_new_tokens", "rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected >= 1")

    from megatron_specdec import distributed
    from megatron_specdec.cli.common import setup_logging
    from megatron_specdec.data import end_of_turn_ids, load_tokenizer
    from megatron_specdec.evaluation.acceptance import read_prompts
    from megatron_specdec.loading.source import load_model

    setup_logging()
    distributed.initialize(1, 1)
    loaded = load_model(args.model, need_draft=True)
    model, tokenizer = loaded.model.eval(), load_tokenizer(str(loaded.tokenizer_dir))
    prompts = [ids for _, ids in read_prompts(args.data, tokenizer)[::10][: args.num_prompts]]
    return model, prompts, end_of_turn_ids(tokenizer)


def main():
    p = alternation_parser(__doc__, 8, 128, 3, "a speculative checkpoint (EAGLE3)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    model, prompts, eos = load_alternation(args)

    from megatron_specdec.inference.generation import GREEDY_CHAIN_ENV, plain_generate
    from megatron_specdec.inference.generator import SpeculativeGenerator

    generator = SpeculativeGenerator(model)
    machine = describe_machine()

    def run(path: str, prompt) -> dict:
        os.environ[GREEDY_CHAIN_ENV] = "1" if path == "chain" else "0"
        start = time.perf_counter()
        plain = plain_generate(model.base, [prompt], args.max_new_tokens, model.vocab_size,
                               eos)[0]
        middle = time.perf_counter()
        spec = generator.generate(prompt, args.max_new_tokens, eos).tokens
        return {"plain": (plain, middle - start), "eagle3": (spec, time.perf_counter() - middle)}

    for path in PATHS:  # untimed: first-use work (kernel choices, the head's screen)
        run(path, prompts[0][:16])
    totals = {mode: {path: [0, 0.0] for path in PATHS} for mode in ("plain", "eagle3")}
    ratios = {mode: [] for mode in totals}
    identical = 0
    for r in range(args.rounds):
        per_round = {mode: {path: [0, 0.0] for path in PATHS} for mode in totals}
        for i, prompt in enumerate(prompts):
            order = PATHS if (i + r) % 2 == 0 else PATHS[::-1]
            got = {path: run(path, prompt) for path in order}
            identical += all(got["general"][m][0] == got["chain"][m][0] for m in totals)
            for mode in totals:
                for path in PATHS:
                    tokens, seconds = got[path][mode]
                    for acc in (totals[mode][path], per_round[mode][path]):
                        acc[0] += len(tokens)
                        acc[1] += seconds
        for mode, by_path in per_round.items():
            speed = {path: n / t for path, (n, t) in by_path.items()}
            ratios[mode].append(speed["chain"] / speed["general"])
        print(f"round {r + 1}: " + ", ".join(f"{mode} {x[-1]:.3f}x" for mode, x in ratios.items()),
              flush=True)
    os.environ.pop(GREEDY_CHAIN_ENV)
    report = {
        "machine": machine, "read_bandwidth_gb_s_after": round(read_bandwidth_gbs(), 2),
        "date": time.strftime("%Y-%m-%d"), "model": args.model,
        "prompts": f"{args.data}, every 10th question, {len(prompts)}",
        "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
        "identical": f"{identical}/{args.rounds * len(prompts)}",
        "tokens_per_s": {mode: {path: round(n / t, 2) for path, (n, t) in by_path.items()}
                         for mode, by_path in totals.items()},
        "chain_over_general": {mode: {"median": round(statistics.median(x), 4),
                                      "rounds": [round(v, 4) for v in x]}
                               for mode, x in ratios.items()},
    }
    write_report(Path(args.out), report)
    print(f"{machine['cpu']}, read {machine['read_bandwidth_gb_s']:.1f} GB/s; identical "
          f"{report['identical']}")
    for mode, speeds in report["tokens_per_s"].items():
        print(f"{mode}: general step {speeds['general']:.2f} tokens/s, greedy chain "
              f"{speeds['chain']:.2f} ({report['chain_over_general'][mode]['median']:.3f}x, "
              f"median of rounds)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

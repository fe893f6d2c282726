"""What a speculative round that drafts nothing costs over a plain greedy step. A drafter that
never proposes makes nearly every round one the draft policy sits out (after the first, its
backoff sits out up to 32 in a row); each prompt runs through `plain_generate` and that
generator in alternating order, in one process, and the outputs must be identical. Such a
round ran the general round's bookkeeping (the proposal and verdict tensors, the verify op on
no drafts, the rewind) until the generator's `_idle_round` left it out; the ratio is what is
left.

    python bench/probes/idle_round.py --model runs/base_shipped_eagle3 [--rounds 5] \
        [--num-prompts 4] [--max-new-tokens 96] [--out FILE.json]
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_greedy_chain import alternation_parser, load_alternation  # noqa: E402
from bench_linear import describe_machine, write_report  # noqa: E402


class NeverDrafts:
    """A drafter that proposes no token: the policy then sits out nearly every round."""

    def start(self, *args):
        pass

    def accept(self, *args):
        pass

    def keep_rows(self, rows):
        pass

    def propose(self, k, policy):
        none = torch.zeros(1, 0, dtype=torch.long)
        return none, none.new_zeros(1)


def main():
    p = alternation_parser(__doc__, 4, 96, 5, "a speculative checkpoint (its base is used)")
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args()
    model, prompts, eos = load_alternation(args)

    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.inference.generator import SpeculativeGenerator

    generator = SpeculativeGenerator(model, drafter=NeverDrafts())
    machine = describe_machine()
    modes = {
        "plain": lambda ids, n: plain_generate(model.base, [ids], n, model.vocab_size, eos)[0],
        "idle_rounds": lambda ids, n: generator.generate(ids, n, eos).tokens,
    }
    for run in modes.values():  # untimed: first-use work
        run(prompts[0][:16], 8)
    per_round = []
    for r in range(args.rounds):
        totals = {name: [0, 0.0] for name in modes}
        for i, ids in enumerate(prompts):
            order = list(modes) if (i + r) % 2 == 0 else list(modes)[::-1]
            got = {}
            for name in order:
                start = time.perf_counter()
                got[name] = modes[name](ids, args.max_new_tokens)
                totals[name][0] += len(got[name])
                totals[name][1] += time.perf_counter() - start
            if got["plain"] != got["idle_rounds"]:
                raise SystemExit(f"prompt {i}: the idle rounds' output differs from greedy")
        speed = {name: n / s for name, (n, s) in totals.items()}
        per_round.append({**speed, "ratio": speed["idle_rounds"] / speed["plain"]})
        print(f"round {r}: plain {speed['plain']:.2f} tokens/s, idle rounds "
              f"{speed['idle_rounds']:.2f} ({per_round[-1]['ratio']:.3f}x)", flush=True)
    median = statistics.median(x["ratio"] for x in per_round)
    print(f"median idle round / plain step speed: {median:.3f}")
    if args.out:
        write_report(Path(args.out), {
            "what": "plain greedy against speculative rounds that draft nothing",
            "machine": machine, "model": args.model, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "rounds": per_round, "median_ratio": median})


if __name__ == "__main__":
    sys.exit(main())

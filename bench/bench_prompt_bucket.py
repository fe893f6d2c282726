"""What padding a prompt batch to a multiple of `prompt_bucket` tokens costs the prefill
(generation.left_pad; it bounds the prefill shapes a long bf16 generation run meets).

SmolLM2's base prefills each of the first --num-prompts GSM8K chat prompts (51-209 tokens:
the generation soak's prompts) at its exact length and padded up to each of --buckets, in each
of --dtypes: after one warm-up forward of each width (a bf16 kernel's creation is not
counted), --repeats rounds time every width once each, interleaved so that other load on the
machine falls on all of them alike; the fastest of each is kept (the least disturbed).
Reports the mean ms per prefill per bucket and its cost relative to the exact lengths, and,
over the first 1,000 GSM8K prompts, the distinct prefill widths each bucket leaves (one bf16
kernel set each) and the share of padding tokens. JSON (rewritten after each dtype) in
bench/results/prefill_cost_prompt_bucket.json.

    python bench/bench_prompt_bucket.py [--num-prompts 24] [--buckets 8 16 32 64] \
        [--dtypes bfloat16 float32]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_linear import describe_machine  # noqa: E402


def prefill_ms(model, vocab_size: int, length: int, widths: list, repeats: int) -> list:
    """Fastest ms of one prompt of `length` tokens prefilled as a chunk of each width."""
    from megatron_specdec.inference.generation import StageRunner

    torch.manual_seed(length)
    prompt = torch.randint(1, vocab_size, (length,))
    counts = torch.tensor([length])
    times = [[] for _ in widths]
    for i in range(repeats + 1):
        for width, seen in zip(widths, times):
            tokens = torch.zeros(1, width, dtype=torch.long)
            tokens[0, width - length:] = prompt
            runner = StageRunner(model, 1, width + 1, vocab_size)
            started = time.perf_counter()
            runner.step(tokens, last_only=True, counts=counts)
            if i:  # the first forward of a shape creates its kernels
                seen.append(1000 * (time.perf_counter() - started))
    return [min(t) for t in times]


def gsm8k_prompts(tokenizer, n: int) -> list:
    with open(ROOT / "data" / "sources" / "gsm8k_train.jsonl") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(n), f)]
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                    tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"] for q in questions]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--buckets", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench/results/prefill_cost_prompt_bucket.json"))
    args = p.parse_args()
    if min(args.buckets) < 1 or args.num_prompts < 1 or args.repeats < 1:
        raise SystemExit("--buckets/--num-prompts/--repeats: every value must be >= 1")
    from megatron_specdec import distributed, load_model
    from megatron_specdec.checkpointing.checkpoint import dtype_from_name
    from megatron_specdec.data import load_tokenizer
    from megatron_specdec.training.batches import bucketed

    about = describe_machine()
    distributed.initialize(1, 1)
    doc = {"machine": about, "buckets": args.buckets, "repeats": args.repeats,
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "dtypes": {}}
    out = Path(args.out)
    try:
        for name in args.dtypes:
            loaded = load_model("default", dtype_from_name(name), with_draft=False)
            model, vocab = loaded.model.eval(), loaded.hf_config.vocab_size
            if "gsm8k_1000" not in doc:
                every = [len(ids) for ids in gsm8k_prompts(
                    load_tokenizer(str(loaded.tokenizer_dir)), 1000)]
                doc["gsm8k_1000"] = {
                    b: {"distinct_widths": len({bucketed(n, b, 1 << 30) for n in every}),
                        "padding_pct": 100 * (sum(bucketed(n, b, 1 << 30) for n in every)
                                              / sum(every) - 1)}
                    for b in [1] + args.buckets}
                doc["lengths"] = every[:args.num_prompts]
            with torch.inference_mode():
                got = [prefill_ms(model, vocab, n, [n] + [bucketed(n, b, 1 << 30)
                                                          for b in args.buckets], args.repeats)
                       for n in doc["lengths"]]
            exact = statistics.mean(g[0] for g in got)
            table = {"exact_ms": [g[0] for g in got], "mean_exact_ms": exact, "buckets": {}}
            for i, b in enumerate(args.buckets):
                ms = [g[1 + i] for g in got]
                table["buckets"][b] = {"ms": ms, "mean_ms": statistics.mean(ms),
                                       "overhead_pct": 100 * (statistics.mean(ms) / exact - 1)}
            doc["dtypes"][name] = table
            print(f"{name} ({about.get('cpu')}, {about.get('commit')}): exact {exact:.1f} ms "
                  f"per prefill over {len(got)} GSM8K prompts")
            for b, row in table["buckets"].items():
                g = doc["gsm8k_1000"][b]
                print(f"  bucket {b:>3}: {row['mean_ms']:.1f} ms ({row['overhead_pct']:+.1f}%); "
                      f"1,000 prompts: {g['distinct_widths']} widths, "
                      f"{g['padding_pct']:+.1f}% tokens")
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(out)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()

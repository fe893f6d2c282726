"""Where a decoding forward's time goes on this machine: the embedded SmolLM2 (fp32, batch 1)
over a 128-token context, forwards of q = 1, 2, 4, 8, 16 tokens (a plain step, verify forwards)
through the decoding path as greedy decoding runs it (the decoding layer,
models/layers/decode_layer.py, and the argmax ids of the greedy head,
models/layers/greedy_head.py) and through megatron's TransformerLayer forward to logits,
beside the weight products alone and the read-bandwidth bound (of the float32 weights).
The products are timed at each q twice: from memory, in a step's order, and with each weight
held in cache (a slice of at most RESIDENT_BYTES of its rows, called back to back, scaled to the
whole weight), which is their arithmetic alone. With reading and multiplying overlapped
perfectly the products at q rows would cost the longer of their arithmetic and the one-row
read: `products_floor_x_one_row` = max(in cache at q, from memory at 1) / from memory at 1,
against which the products from memory at q show how much of the two the kernel overlaps.
With `--draft SPEC_CKPT` (an EAGLE3 checkpoint) the base is that checkpoint's, and a draft
step (one chained token: the draft layers and its lm_head) is timed too, through the draft's
decoding path (Eagle3Layer.decode) and through its layers' forward. With `--bf16-values`
every weight of the base is first rounded to a bfloat16 value, as a base trained in bf16 holds
them: its decoding products then read their 16-bit copies (weight_memory.streamed), and the
bound is that of the bytes they read.

    python bench/bench_decode_step.py [--repeats 30] [--draft runs/base_shipped_eagle3] \
        [--bf16-values] [--out bench/results/decode_step.json]

Each figure is the median of `repeats` forwards, the two paths interleaved. Writes the CPU
model, threads, the measured read bandwidth, the commit and the load average with them.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import commit, read_bandwidth_gbs, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "decode_step.json"
QUERIES = (1, 2, 4, 8, 16)
CONTEXT = 128
# A weight slice this size stays in every x86 server CPU's last-level cache.
RESIDENT_BYTES = 4 << 20


def weights_of(base):
    """The decoding products' weights of a step, in order (four a layer, then the output)."""
    weights = []
    for layer in base.decoder.layers:
        attention, mlp = layer.self_attention, layer.mlp
        weights += [attention.linear_qkv.weight, attention.linear_proj.weight,
                    mlp.linear_fc1.weight, mlp.linear_fc2.weight]
    return weights + [base.shared_embedding_or_output_weight()
                      if base.share_embeddings_and_output_weights else base.output_layer.weight]


def time_products(products, read, q: int, repeats: int) -> dict:
    """Median ms of a step's products at q rows of x: from memory (each weight once, in the
    step's order) and with each weight in cache (the sum over weights of a slice's best time
    of back-to-back calls, at least five, scaled by the weight's rows over the slice's)."""
    inputs = {w.shape[1]: torch.randn(q, w.shape[1]) for w in read}
    from_memory = []
    for _ in range(repeats):
        start = time.perf_counter()
        for fn, w in zip(products, read):
            fn(inputs[w.shape[1]], w)
        from_memory.append((time.perf_counter() - start) * 1e3)
    in_cache, best = 0.0, {}
    for fn, w in zip(products, read):
        key = (fn, tuple(w.shape), w.dtype)
        if key not in best:
            rows = max(1, min(w.shape[0], RESIDENT_BYTES // (w.shape[1] * w.element_size())))
            part, x = w[:rows], inputs[w.shape[1]]
            calls = []
            for _ in range(max(5, repeats)):
                start = time.perf_counter()
                fn(x, part)
                calls.append(time.perf_counter() - start)
            best[key] = min(calls) * 1e3 * w.shape[0] / rows
        in_cache += best[key]
    return {"from_memory": statistics.median(from_memory), "in_cache": in_cache}


def set_lean(base, lean: bool):
    for layer in base.decoder.layers:
        layer.__dict__["lean"] = lean and type(layer).lean.func(layer)


def load_eagle3(path: str):
    from megatron_specdec.loading.speculative import load_speculative

    model, _, _ = load_speculative(path)
    if model.algo != "eagle3":
        raise SystemExit(f"--draft {path}: an EAGLE3 checkpoint is needed, this one's draft is "
                         f"{model.algo}")
    return model.eval()


def time_draft_step(model, repeats: int) -> dict:
    """Median ms of one chained draft step (a fixed chain of 8 after a CONTEXT-token prefill,
    per step), by the draft's decoding path and by its layers' forward, interleaved; the
    draft's weight MB."""
    from megatron_specdec.inference.draft_policy import DraftPolicy
    from megatron_specdec.inference.generator import build_drafter
    from megatron_specdec.inference.base_runner import BaseRunner

    steps = 8
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (1, CONTEXT), generator=g)
    drafter = build_drafter(model)
    fixed = DraftPolicy.named("fixed", steps)
    runner = BaseRunner(model, 1, CONTEXT + 1)
    times = {"decode": [], "forward": []}
    with torch.no_grad():
        out = runner.step(prompt, last_only=True)
        drafter.start(prompt, torch.tensor([CONTEXT]), out.logits[:, -1:].argmax(-1), out,
                      CONTEXT + steps + 1)
        for _ in range(repeats + 2):
            for path in times:
                model.draft.__dict__["lean"] = path == "decode" and type(model.draft).lean.func(
                    model.draft)
                start = time.perf_counter()
                drafter.propose(steps, fixed)  # steps - 1 draft forwards after the first token
                times[path].append((time.perf_counter() - start) * 1e3 / (steps - 1))
    model.draft.__dict__.pop("lean")
    weight_bytes = sum(w.numel() * w.element_size() for w in model.draft.parameters())
    return {"step_ms": {path: round(statistics.median(t[2:]), 3) for path, t in times.items()},
            "weight_mb": round(weight_bytes / 1e6, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--draft", help="an EAGLE3 speculative checkpoint: time its draft step too")
    p.add_argument("--bf16-values", action="store_true",
                   help="round the base's weights to bfloat16 values first (a base trained in bf16)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: expected >= 1")

    from megatron_specdec import distributed
    from megatron_specdec.cli.common import setup_logging
    from megatron_specdec.inference.generation import StageRunner
    from megatron_specdec.loading.hf_conversion import model_from_hf
    from megatron_specdec.models.default_model import default_model_dir
    from megatron_specdec.models.layers.linear_kernels import machine, product, skinny_schedule
    from megatron_specdec.models.weight_memory import streamed

    setup_logging()
    distributed.initialize(1, 1)
    if args.draft:
        model = load_eagle3(args.draft)
        base = model.base
    else:
        model, (base, _) = None, model_from_hf(default_model_dir())
    base.eval()
    if args.bf16_values:
        with torch.no_grad():
            for p in base.parameters():
                p.copy_(p.bfloat16().float())
    load_before = os.getloadavg()[0]
    bandwidth = read_bandwidth_gbs()
    weights = weights_of(base)
    # The layers' products read what `streamed` gives them; the output layer counts its float32
    # bytes (the greedy head reads a quarter of them, the logits path all).
    weight_bytes = sum(w.numel() * w.element_size() for w in map(streamed, weights[:-1]))
    weight_bytes += weights[-1].numel() * weights[-1].element_size()
    bound_ms = weight_bytes / bandwidth / 1e6

    g = torch.Generator().manual_seed(0)
    runner = StageRunner(base, 1, CONTEXT + max(QUERIES) + 1, base.vocab_size)
    times = {path: {q: [] for q in QUERIES} for path in ("decode", "forward")}
    with torch.no_grad():
        runner.step(torch.randint(0, 49152, (1, CONTEXT), generator=g), last_only=True)
        for _ in range(args.repeats + 2):  # two warm-up rounds
            for q in QUERIES:
                tokens = torch.randint(0, 49152, (1, q), generator=g)
                for path in times:
                    set_lean(base, path == "decode")
                    start = time.perf_counter()
                    runner.step(tokens, greedy=path == "decode")
                    times[path][q].append((time.perf_counter() - start) * 1e3)
                    runner.rewind(q)
        gemm = {}
        *layer_weights, output = weights
        for q in QUERIES:
            products = [product(w, q) for w in weights]
            # The skinny op reads a layer weight's 16-bit copy, as the decoding layer does.
            read = [streamed(w) if skinny_schedule(fn) is not None else w
                    for fn, w in zip(products, layer_weights)] + [output]
            gemm[q] = time_products(products, read, q, args.repeats)
    set_lean(base, True)
    draft = None if model is None else time_draft_step(model, args.repeats)
    median = {path: {q: statistics.median(t[2:]) for q, t in by_q.items()}
              for path, by_q in times.items()}
    report = {
        "machine": machine(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
        "weights": "bf16 values" if args.bf16_values else "as loaded",
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "read_bandwidth_gbs": round(bandwidth, 2), "weight_mb": round(weight_bytes / 1e6, 1),
        "bound_ms": round(bound_ms, 2), "context": CONTEXT, "repeats": args.repeats,
        "products_ms": {where: {str(q): round(t[where], 2) for q, t in gemm.items()}
                        for where in ("from_memory", "in_cache")},
        "products_floor_x_one_row": {
            str(q): round(max(t["in_cache"], gemm[1]["from_memory"]) / gemm[1]["from_memory"], 2)
            for q, t in gemm.items()},
        "forward_ms": {path: {str(q): round(ms, 2) for q, ms in by_q.items()}
                       for path, by_q in median.items()},
        **({} if draft is None else {"draft": {"checkpoint": args.draft, **draft}}),
    }
    out = Path(args.out)
    write_report(out, report)
    m = report["machine"]
    print(f"{m['cpu']} ({', '.join(m['flags'])}), {m['threads']} threads; read {bandwidth:.1f} GB/s, "
          f"{report['weight_mb']} MB of weights: bound {bound_ms:.1f} ms a step")
    print("| tokens | decoding layer ms | megatron forward ms | x one-token (decoding layer) | "
          "products from memory ms | products in cache ms | products' floor x one row |")
    print("|---|---|---|---|---|---|---|")
    for q in QUERIES:
        print(f"| {q} | {median['decode'][q]:.1f} | {median['forward'][q]:.1f} | "
              f"{median['decode'][q] / median['decode'][1]:.2f} | {gemm[q]['from_memory']:.1f} | "
              f"{gemm[q]['in_cache']:.1f} | {report['products_floor_x_one_row'][str(q)]:.2f} |")
    if draft is not None:
        print(f"draft step ({draft['weight_mb']} MB of weights): decoding path "
              f"{draft['step_ms']['decode']:.2f} ms, layers' forward "
              f"{draft['step_ms']['forward']:.2f} ms")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Fused acceptance ops vs the PyTorch reference: median wall time per call.

Drafts come from a noisy copy of the target (draft logits = target + noise), so
about 0.7 of the draft mass is accepted per position, as with a trained draft. Both sides get the
same inputs and uniforms and must return the same tokens (checked here too).
Prints a table and writes bench/results/acceptance_cpu.json (and
acceptance_cuda.json with CUDA vs reference when a GPU is present): every op at B=1/8/64
(K=4/8 for the chains), vocab 49152 (SmolLM2) and, on the GPU, 128256 (Llama 3) too.

    python bench/bench_acceptance.py [--repeats 5] [--threads N] [--vocab 49152 ...]
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch

import megatron_specdec._C  # noqa: F401  (registers torch.ops.megatron_specdec)
from megatron_specdec.acceptance import reference

OPS = torch.ops.megatron_specdec


def _time(fn, repeats, device):
    """(median, min) wall seconds; min is the less load-sensitive figure on a shared machine."""
    fn()  # warm-up (allocations, first-touch, lazy init)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return (statistics.median(times), min(times)), out


def _chain_inputs(batch, k, vocab, device, gen):
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 4.0
    draft_logits = target[:, :k] + torch.randn(batch, k, vocab, generator=gen) * 0.8
    q = draft_logits.softmax(-1)
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    lens = torch.full((batch,), k, dtype=torch.long)
    uniforms = torch.rand(batch, k + 1, generator=gen)
    to = lambda t: t.to(device)  # noqa: E731
    return to(draft), to(target), to(lens), to(q), to(uniforms), to(draft_logits.argmax(-1))


def _tree_inputs(batch, vocab, device, gen):
    # Two levels of top-3 children below the root plus one chain of 3 under the first: N = 15.
    parents = [-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 12, 13]
    n = len(parents)
    par = torch.tensor(parents).expand(batch, n).contiguous()
    target = torch.randn(batch, n + 1, vocab, generator=gen) * 4.0
    ids = torch.empty(batch, n, dtype=torch.long)
    for i, up in enumerate(parents):
        ids[:, i] = (target[:, up + 1] + torch.randn(batch, vocab, generator=gen) * 0.8).argmax(-1)
    uniforms = torch.rand(batch, n + 1, generator=gen)
    nodes = torch.full((batch,), n, dtype=torch.long)
    depth = int(reference.tree_depths(par, nodes).max())
    to = lambda t: t.to(device)  # noqa: E731
    return to(ids), to(par), to(target), to(nodes), to(uniforms), depth


def _cases(vocab, device, gen):
    for batch in (1, 8, 64):
        for k in (4, 8):
            draft, target, lens, q, u, greedy_draft = _chain_inputs(batch, k, vocab, device, gen)
            size = f"B={batch} K={k}"
            yield ("greedy_chain", size,
                   lambda: OPS.greedy_chain_verify(greedy_draft, target, lens),
                   lambda: reference.greedy_chain_verify(greedy_draft, target, lens))
            yield ("stochastic_chain", size,
                   lambda: OPS.stochastic_chain_verify(draft, target, lens, q, u, 1.0, 0, 1.0),
                   lambda: reference.stochastic_chain_verify(draft, target, lens, q, u, 1.0, 0, 1.0))
            yield ("stochastic_chain q=None T=0.7", size,
                   lambda: OPS.stochastic_chain_verify(greedy_draft, target, lens, None, u, 0.7, 0, 1.0),
                   lambda: reference.stochastic_chain_verify(greedy_draft, target, lens, None, u, 0.7, 0, 1.0))
            yield ("typical", size,
                   lambda: OPS.typical_verify(greedy_draft, target, lens, 0.7, 0.09, 0.3),
                   lambda: reference.typical_verify(greedy_draft, target, lens, 0.7, 0.09, 0.3))
    for batch in (1, 8, 64):
        ids, par, target, nodes, u, depth = _tree_inputs(batch, vocab, device, gen)
        size = f"B={batch} N=15"
        yield ("tree_greedy", size,
               lambda: OPS.tree_verify_greedy(ids, par, target, nodes, depth),
               lambda: reference.tree_verify_greedy(ids, par, target, nodes, depth))
        yield ("tree_stochastic q=None", size,
               lambda: OPS.tree_verify_stochastic(ids, par, target, nodes, None, u, depth, 1.0, 0, 1.0),
               lambda: reference.tree_verify_stochastic(ids, par, target, nodes, None, u, depth, 1.0, 0, 1.0))


def run(device, vocab, repeats, only=None):
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'op':30s} {'size':10s} {'fused ms':>9s} {'ref ms':>9s} {'speedup':>8s} "
          f"{'(min: fused':>12s} {'ref':>8s} {'speedup)':>9s} {'accepted':>9s}")
    for name, size, fused, ref in _cases(vocab, device, gen):
        if only and f"{name} {size}" != only:
            continue
        (t_fused, min_fused), out_fused = _time(fused, repeats, device)
        (t_ref, min_ref), out_ref = _time(ref, repeats, device)
        same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(out_fused, out_ref))
        if not same:
            print(f"{name} {size}: fused and reference outputs DIFFER")
        accepted = out_fused[1].double().mean().item()
        rows.append(dict(op=name, size=size, vocab=vocab, fused_ms=t_fused * 1e3, reference_ms=t_ref * 1e3,
                         speedup=t_ref / t_fused, fused_min_ms=min_fused * 1e3, reference_min_ms=min_ref * 1e3,
                         speedup_min=min_ref / min_fused, mean_accepted=accepted, same_tokens=same))
        print(f"{name:30s} {size:10s} {t_fused * 1e3:9.3f} {t_ref * 1e3:9.2f} {t_ref / t_fused:7.1f}x "
              f"{min_fused * 1e3:12.3f} {min_ref * 1e3:8.2f} {min_ref / min_fused:8.1f}x {accepted:9.2f}")
    return rows


def main():
    from megatron_specdec.cli.common import setup_logging

    setup_logging()  # quiet logs: benign library warnings off
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--vocab", type=int, nargs="+", default=None,
                        help="vocabulary sizes (default: 49152 on the CPU, 49152 and 128256 on the GPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="one device only (default: the CPU, and the GPU when there is one)")
    parser.add_argument("--only", default=None,
                        help='one case, e.g. "stochastic_chain B=64 K=8" (for profilers; writes no JSON)')
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="where acceptance_<device>.json goes (default bench/results)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = args.out_dir
    os.makedirs(out_dir, exist_ok=True)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    if args.device:
        devices = [torch.device(args.device)]
    failed = []
    for device in devices:
        vocabs = args.vocab or ([49152] if device.type == "cpu" else [49152, 128256])
        rows = []
        for vocab in vocabs:
            print(f"\n{device.type}: vocab {vocab}, median of {args.repeats}, {torch.get_num_threads()} threads, "
                  f"load average {os.getloadavg()[0]:.1f}")
            rows += run(device, vocab, args.repeats, args.only)
        failed += [f"{r['op']} {r['size']} V={r['vocab']} ({device.type})" for r in rows if not r["same_tokens"]]
        if args.only:
            continue
        meta = dict(device=device.type, vocabs=vocabs, repeats=args.repeats, threads=torch.get_num_threads(),
                    load_average=os.getloadavg(),
                    torch=torch.__version__, cpu=platform.processor() or platform.machine(),
                    gpu=torch.cuda.get_device_name() if device.type == "cuda" else None)
        path = os.path.join(out_dir, f"acceptance_{device.type}.json")
        with open(path, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)
        print(f"wrote {path}")
    if failed:
        raise SystemExit(f"fused and reference outputs differ: {', '.join(failed)}")


if __name__ == "__main__":
    main()

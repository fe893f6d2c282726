"""Peak host memory of one EAGLE3 training step, TTT attention old vs new.

    nice -n 10 python bench/bench_ttt_memory.py [--seqs 1024 2048 4096] [--limit-gib 13]
    nice -n 10 python bench/bench_ttt_memory.py --attention-only   # the attention alone

The step: forward and backward of an EAGLE3 draft shaped as Llama-3.1-8B's (hidden 4096,
32/8 heads, intermediate 14336, vocabulary 128256, draft vocabulary 32000, one layer,
7 TTT steps) over a 2-layer random base of the same shape, bf16, batch 1, the second half
of the row scored (a prompt of s/2 tokens). "new" is `methods/eagle3/ttt_attention.py`; "old" is
its version at commit 70cdf82 (one s x s fp32 score block per step and head, softmaxed
together with the per-step chain scores), read with `git show` and put in its place.

Each (implementation, s) runs in a child process: it builds the model, resets the kernel's
peak-RSS counter (/proc/self/clear_refs), runs the step and reports VmHWM (the step's
peak RSS: weights, gradients, activations) and the RSS before the step. A watchdog in the
child exits it once its RSS passes --limit-gib (the machine is shared; it has no swap),
and a run whose step memory, extrapolated quadratically (old) from the last s, would pass
the limit is not started. Writes bench/results/ttt_memory.json and prints a table.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_COMMIT = "70cdf82"
GIB = 2**30


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _watchdog(limit_bytes: int):
    def watch():
        while True:
            if _status_kib("VmRSS") * 1024 > limit_bytes:
                print(json.dumps({"error": f"RSS passed {limit_bytes / GIB:.1f} GiB"}), flush=True)
                os._exit(3)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()


def _old_attention():
    """The TTT attention of OLD_COMMIT, called as the new one is."""
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:megatron_specdec/layers/ttt_attention.py"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    old = types.ModuleType("ttt_attention_old")
    exec(compile(source, "ttt_attention_old.py", "exec"), old.__dict__)

    def attention(query, blocks, mask, scale, dropout_p=0.0):
        return old.ttt_attention(query, blocks, old.TTTMask(mask.base_mask, mask.step), scale)

    return attention


def _attention_step(attention, s: int):
    """Inputs of the TTT attention alone (one draft layer, the 8B draft's 32/8 heads of 128,
    7 steps, bf16), and a function running its forward and backward over all steps."""
    import torch

    from megatron_specdec.methods.eagle3.ttt_attention import TTTMask

    g = torch.Generator().manual_seed(0)

    def rand(heads):
        return torch.randn(s, 1, heads, 128, generator=g).to(torch.bfloat16).requires_grad_()

    queries = [rand(32) for _ in range(7)]
    blocks = [(rand(8), rand(8)) for _ in range(7)]

    def step():
        outs = [attention(q, blocks[: k + 1], TTTMask(None, k), 128 ** -0.5)
                for k, q in enumerate(queries)]
        sum(o.float().sum() for o in outs).backward()

    return step


def child(impl: str, s: int, limit_gib: float, attention_only: bool, recompute: bool):
    import torch
    from transformers import LlamaConfig

    from megatron_specdec import distributed
    from megatron_specdec.methods.eagle3 import draft_layer as eagle3_layer, ttt_attention
    from megatron_specdec.models.provider import build_model
    from megatron_specdec.models.speculative import convert

    _watchdog(int(limit_gib * GIB))
    attention = _old_attention() if impl == "old" else ttt_attention.ttt_attention
    if attention_only:
        step, grads = _attention_step(attention, s), None
    else:
        eagle3_layer.ttt_attention = attention
        distributed.initialize(1, 1)
        hf = LlamaConfig(num_hidden_layers=2, hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                         max_position_embeddings=8192, tie_word_embeddings=False,
                         rope_theta=500000.0, rms_norm_eps=1e-5)
        torch.manual_seed(0)
        # megatron's full-layer recomputation switch; the draft reads it (the base is frozen)
        recompute_args = dict(recompute_granularity="full", recompute_method="uniform",
                              recompute_num_layers=1) if recompute else {}
        base = build_model(hf, dtype=torch.bfloat16, perform_initialization=False,
                           **recompute_args)
        with torch.no_grad():  # uniform fill: megatron's initialisation takes minutes here
            for p in base.parameters():
                p.uniform_(-0.02, 0.02) if p.dim() > 1 else p.fill_(1.0)
        model = convert(base, "eagle3", {"draft_vocab_size": 32000, "ttt_steps": 7,
                                         "eagle_num_layers": 1,
                                         "eagle_aux_hidden_state_layer_ids": [0, 1, 1]},
                        hf_config=hf)
        ids = torch.randint(0, hf.vocab_size, (1, s))
        loss_mask = torch.zeros(1, s, dtype=torch.long)
        loss_mask[:, s // 2:] = 1

        def step():
            model(ids, loss_mask)["loss_sum"].backward()

    before = _status_kib("VmRSS") * 1024
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    start = time.time()
    step()
    seconds = time.time() - start
    peak = _status_kib("VmHWM") * 1024
    print(json.dumps({"impl": impl, "seq": s, "recompute": recompute,
                      "rss_before_mib": before / 2**20,
                      "peak_mib": peak / 2**20, "step_mib": (peak - before) / 2**20,
                      "seconds": seconds}), flush=True)


def run_child(impl: str, s: int, limit_gib: float, attention_only: bool,
              recompute: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--seqs", str(s), "--limit-gib", str(limit_gib)]
    cmd += ["--attention-only"] * attention_only + ["--recompute"] * recompute
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"impl": impl, "seq": s, "error": f"exit {out.returncode}: {out.stderr[-500:]}"}
    return {"impl": impl, "seq": s, **json.loads(lines[-1])}


def _write(path, rows):
    """Merge the rows so far into `path` by (what, impl, s): a long run leaves what it has
    measured, and the step and attention-only runs share the file. Returns the load."""
    key = lambda r: (r.get("what", "step"), r["impl"], r["seq"], r.get("recompute"))  # noqa: E731
    kept = json.loads(Path(path).read_text())["rows"] if Path(path).is_file() else []
    new = {key(r) for r in rows}
    load = os.getloadavg()
    Path(path).write_text(json.dumps({
        "step": "Llama-3.1-8B draft (1 layer, h 4096, 32/8 heads, ffn 14336, V 128256, "
                "draft V 32000) over a 2-layer random base, bf16, batch 1, 7 TTT steps, "
                "half the row scored; forward + backward",
        "attention": "the TTT attention alone: 7 steps of one layer, 32/8 heads of 128, bf16, "
                     "forward + backward",
        "recompute": "the draft layer recomputed in backward (recompute_granularity=full)",
        "old": f"layers/ttt_attention.py at {OLD_COMMIT}", "load_avg": load,
        "rows": [r for r in kept if key(r) not in new] + rows}, indent=1) + "\n")
    return load


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--impls", nargs="+", default=["new", "old"])
    p.add_argument("--limit-gib", type=float, default=13.0)
    p.add_argument("--child", choices=["new", "old"])
    p.add_argument("--attention-only", action="store_true",
                   help="the TTT attention alone (one layer's 7 steps), not the training step")
    p.add_argument("--recompute", action="store_true",
                   help="recompute the draft layer in backward (megatron's recompute_granularity=full)")
    p.add_argument("--out", default=str(ROOT / "bench/results/ttt_memory_chunked.json"))
    args = p.parse_args()
    if args.child:
        return child(args.child, args.seqs[0], args.limit_gib, args.attention_only, args.recompute)
    rows, last = [], {}
    what = "attention" if args.attention_only else "step"
    for s in args.seqs:
        for impl in args.impls:
            prev = last.get(impl)
            if prev is not None and "step_mib" in prev:
                growth = (s / prev["seq"]) ** (2 if impl == "old" else 1)
                predicted = prev["rss_before_mib"] + prev["step_mib"] * growth
                if predicted > args.limit_gib * 1024:
                    rows.append({"what": what, "impl": impl, "seq": s, "skipped": f"predicted peak {predicted:.0f} "
                                 f"MiB > limit {args.limit_gib * 1024:.0f} MiB"})
                    print(rows[-1], flush=True)
                    continue
            last[impl] = run_child(impl, s, args.limit_gib, args.attention_only, args.recompute)
            rows.append({"what": what, **last[impl]})
            print(rows[-1], flush=True)
            _write(args.out, rows)
    load = _write(args.out, rows)
    print(f"\n{'s':>6s} {'impl':5s} {'RSS before MiB':>15s} {'peak MiB':>9s} {'step MiB':>9s} {'s/step':>7s}")
    for r in rows:
        if "step_mib" in r:
            print(f"{r['seq']:6d} {r['impl']:5s} {r['rss_before_mib']:15.0f} {r['peak_mib']:9.0f} "
                  f"{r['step_mib']:9.0f} {r['seconds']:7.1f}")
        else:
            print(f"{r['seq']:6d} {r['impl']:5s} {r.get('skipped') or r.get('error')}")
    print(f"load average after: {load[0]:.1f}")


if __name__ == "__main__":
    main()

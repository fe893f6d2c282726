"""Peak host memory of one EAGLE3 training step over a mixture-of-experts base.

    nice -n 10 python bench/bench_moe_ttt_memory.py [--seqs 1024 2048] [--limit-gib 10] [--recompute]

The step: forward and backward of an EAGLE3 draft shaped for Qwen3-30B-A3B (hidden 2048,
32/4 heads of 128, q/k-norm base, one draft layer of ffn 6144, vocabulary 151936, draft
vocabulary 32000, 7 TTT steps) over a 2-layer random base of Qwen3-30B-A3B's layer shape
(128 experts of ffn 768, top-8, renormalised; megatron's MoELayer with SequentialMLP experts),
bf16, batch 1, the second half of the row scored. The base runs frozen (no_grad), so its
MoE layers add their weights and transient activations, not saved ones.

Each s runs in a child process (bench_ttt_memory's watchdog and VmHWM reading): it builds
the model, resets the peak-RSS counter, runs the step and reports the step's peak RSS over
the RSS before it. Writes bench/results/moe_ttt_memory.json (CPU model and commit in it).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ttt_memory import GIB, _status_kib, _watchdog  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(num_hidden_layers=2, hidden_size=2048, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128, intermediate_size=6144,
            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
            tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
            use_sliding_window=False)
DRAFT = {"draft_vocab_size": 32000, "ttt_steps": 7, "eagle_num_layers": 1,
         "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}


def child(s: int, limit_gib: float, recompute: bool):
    import torch
    from transformers import Qwen3MoeConfig

    from megatron_specdec import distributed
    from megatron_specdec.models.provider import build_model
    from megatron_specdec.models.speculative import convert

    _watchdog(int(limit_gib * GIB))
    distributed.initialize(1, 1)
    hf = Qwen3MoeConfig(**BASE, architectures=["Qwen3MoeForCausalLM"])
    recompute_args = dict(recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1) if recompute else {}
    base = build_model(hf, dtype=torch.bfloat16, perform_initialization=False, **recompute_args)
    torch.manual_seed(0)
    with torch.no_grad():  # uniform fill: megatron's initialisation takes minutes here
        for p in base.parameters():
            p.uniform_(-0.02, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model = convert(base, "eagle3", DRAFT, hf_config=hf)
    ids = torch.randint(0, hf.vocab_size, (1, s))
    loss_mask = torch.zeros(1, s, dtype=torch.long)
    loss_mask[:, s // 2:] = 1
    before = _status_kib("VmRSS") * 1024
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    start = time.time()
    model(ids, loss_mask)["loss_sum"].backward()
    seconds = time.time() - start
    peak = _status_kib("VmHWM") * 1024
    params = {"base": sum(p.numel() for p in model.base.parameters()),
              "draft": sum(p.numel() for p in model.draft.parameters())}
    print(json.dumps({"seq": s, "recompute": recompute, "params": params,
                      "rss_before_mib": before / 2**20, "peak_mib": peak / 2**20,
                      "step_mib": (peak - before) / 2**20, "seconds": seconds}), flush=True)


def run_child(s: int, limit_gib: float, recompute: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--seqs", str(s), "--limit-gib", str(limit_gib)]
    cmd += ["--recompute"] * recompute
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"seq": s, "recompute": recompute,
                "error": f"exit {out.returncode}: {out.stderr[-500:]}"}
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--limit-gib", type=float, default=10.0)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        return child(args.seqs[0], args.limit_gib, args.recompute)
    rows = []
    for s in args.seqs:
        rows.append(run_child(s, args.limit_gib, args.recompute))
        print(rows[-1], flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in
                subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                if line.startswith("Model name")), "unknown")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    out = ROOT / "bench" / "results" / "moe_ttt_memory.json"
    kept = json.loads(out.read_text())["rows"] if out.is_file() else []
    new = {(r["seq"], r["recompute"]) for r in rows}
    result = {"step": "Qwen3-30B-A3B-shaped EAGLE3 draft (1 layer, h 2048, 32/4 heads, ffn "
                      "6144, V 151936, draft V 32000, 7 TTT steps) over a 2-layer random MoE "
                      "base (128 experts of ffn 768, top-8), bf16, batch 1, half the row "
                      "scored; forward + backward",
              "cpu": cpu, "commit": commit, "load_avg": os.getloadavg(),
              "rows": [r for r in kept if (r["seq"], r["recompute"]) not in new] + rows}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Conversion peak memory per rank of an MoE model at EP=1 and EP=2: a random Qwen3-MoE-shaped
model of ~1B parameters (hidden 1024, 12 layers, 16/4 heads of 64, 32 experts of ffn 768,
top-4, vocabulary 32000; 94% of the parameters in experts), written here as bf16 safetensors
in a temporary directory in the per-expert on-disk layout, imported HF -> Megatron with
`hf_conversion.hf_to_megatron(..., ep=N)` (N ranks, each reading only its experts' tensors)
and exported back to HF. Each conversion is its own process tree; peak memory is the largest
total RSS of the tree and of its largest process (a rank), sampled every 20 ms (proc_peak).

    nice -n 10 python bench/bench_moe_conversion.py [--eps 1 2] [--hf-dir DIR] [--no-export]

`--hf-dir` reuses a model this bench wrote (runs at several EPs may then go in parallel: the
figures are per process tree). Rows are merged into bench/results/moe_conversion_peak_rss.json
by (direction, EP), with the CPU model and commit.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_conversion import write_random_hf  # noqa: E402
from proc_peak import measure  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QWEN3_MOE_1B = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=64, intermediate_size=3072,
                    moe_intermediate_size=768, num_experts=32, num_experts_per_tok=4,
                    norm_topk_prob=True, vocab_size=32000, max_position_embeddings=4096,
                    tie_word_embeddings=False, use_sliding_window=False, rms_norm_eps=1e-6)


def write_random_moe(out: Path) -> Path:
    """A random bf16 model of QWEN3_MOE_1B's shape, written one tensor at a time in the
    per-expert layout checkpoints hold on disk."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_specdec.checkpointing import hf_moe as moe

    config = Qwen3MoeConfig(**QWEN3_MOE_1B, architectures=["Qwen3MoeForCausalLM"])
    with torch.device("meta"):
        shapes = moe.disk_shapes("qwen3_moe", {k: v.shape for k, v in
                                               Qwen3MoeForCausalLM(config).state_dict().items()})
    return write_random_hf(out, config, shapes)


def run(what, code, ep):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    seconds, tree, one = measure([sys.executable, "-c", code], env=env, cwd=REPO)
    row = {"direction": what, "ep": ep, "seconds": seconds, "peak_rss_mib": tree,
           "peak_rss_per_rank_mib": one, "load_avg": os.getloadavg()[0]}
    print(row, flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--eps", nargs="+", type=int, default=[1, 2])
    p.add_argument("--hf-dir", type=Path, help="a model this bench wrote before")
    p.add_argument("--no-export", action="store_true", help="import only")
    args = p.parse_args()
    from megatron_specdec.checkpointing import hf_files as files

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir = args.hf_dir.resolve() if args.hf_dir else write_random_moe(tmp / "hf")
        params = sum(torch.Size(s).numel() for s in files.HFTensors(hf_dir).shapes().values())
        for ep in args.eps:
            ckpt, back = tmp / f"ckpt_ep{ep}", tmp / f"hf_ep{ep}"
            rows.append(run("hf_to_megatron", (
                "from megatron_specdec.loading.hf_conversion import hf_to_megatron; "
                f"hf_to_megatron({str(hf_dir)!r}, {str(ckpt)!r}, ep={ep}, dtype='bfloat16')"), ep))
            if not args.no_export:
                rows.append(run("megatron_to_hf", (
                    "from megatron_specdec.loading.hf_conversion import megatron_to_hf; "
                    f"megatron_to_hf({str(ckpt)!r}, {str(back)!r})"), ep))
            subprocess.run(["rm", "-rf", str(ckpt.resolve()), str(ckpt), str(back)], check=True)
    cpu = next((line.split(":", 1)[1].strip() for line in
                subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                if line.startswith("Model name")), "unknown")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    out = REPO / "bench" / "results" / "moe_conversion_peak_rss.json"
    new = {(r["direction"], r["ep"]) for r in rows}
    kept = [r for r in (json.loads(out.read_text())["rows"] if out.is_file() else [])
            if (r["direction"], r["ep"]) not in new]
    for r in rows:
        r.update(cpu=cpu, commit=commit)
    rows = kept + rows
    result = {"model": "random Qwen3-MoE-shaped, bf16", "config": QWEN3_MOE_1B,
              "parameters": params, "torch": torch.__version__,
              "note": "peak_rss_per_rank_mib: the largest process of the tree (a rank; at "
                      "EP=1 the one process). Includes python, torch and megatron-core "
                      "imports. The machine is shared (load_avg per row).",
              "rows": rows}
    print(f"{'direction':<16}{'EP':>4}{'seconds':>10}{'tree MiB':>11}{'per rank MiB':>14}")
    for r in rows:
        print(f"{r['direction']:<16}{r['ep']:>4}{r['seconds']:>10.1f}{r['peak_rss_mib']:>11.0f}"
              f"{r['peak_rss_per_rank_mib']:>14.0f}")
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    tmp_out.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""One training step of an 8B-shaped draft (EAGLE3, or the DFlash block drafter): throughput,
model-FLOPs utilisation, peak memory, and the costliest kernels.

The step is the trainer's: the frozen base forward, the draft's loss (EAGLE3: the
training-time test, 7 steps; DFlash: one forward over blocks of 16 at anchors tiling the
scored half), backward, and `DraftOptimizer`'s AdamW update of fp32 masters. The draft is
shaped as Llama-3.1-8B's (hidden 4096, 32/8 heads, ffn 14336, vocabulary 128256, EAGLE3's
draft vocabulary 32000, one layer) over a 2-layer random base of the same shape, bf16, batch
1, the second half of each row scored. The 8B shape is what matters for a cluster: the
135M SmolLM2 draft leaves a GPU idle between small kernels.

MFU counts the matrix products a step must do (the base forward, the draft's forward and
backward per TTT step, causal attention) against the GPU's dense bf16 peak from its data
sheet, and beside it the rate one large bf16 product reaches on this GPU.

    python bench/bench_train_step.py --device cuda [--seqs 2048 4096] [--profile]
    python bench/bench_train_step.py --device cuda --method dflash
    python bench/bench_train_step.py --device cpu --shape tiny --seqs 64   # the dry run CI runs

Writes bench/results/train_step_<device>.json (train_step_dflash_<device>.json; or --out) and
prints a table.
"""

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {  # hidden, heads, kv heads, ffn, vocab, draft vocab
    "8b": dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, draft_vocab=32000),
    "tiny": dict(hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, draft_vocab=128),
}
TTT_STEPS = 7
BASE_LAYERS = 2
DFLASH_BLOCK = 16  # the published DFlash drafts' block size

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, FLOP/s.
BF16_PEAK = {"H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
             "A100": 312e12, "L40S": 362e12}


def data_sheet_peak(name: str):
    for key, peak in BF16_PEAK.items():  # longest names first in the table above where they nest
        if key in name:
            return peak
    return None


def dflash_anchors(s: int) -> int:
    """Blocks per row: they tile the scored second half."""
    return max(1, (s - s // 2) // DFLASH_BLOCK)


def step_flops(shape: dict, s: int, method: str = "eagle3") -> float:
    """Matrix-product FLOPs of one step (batch 1, sequence s): 2 per multiply-add; backward
    twice the forward; the frozen base has no backward; causal attention counts half its
    s x s products."""
    h, ffn = shape["hidden"], shape["ffn"]
    kv = h // shape["heads"] * shape["kv_heads"]
    attn = 2 * 2 * s * s * h / 2  # QK^T and PV, causal half
    base_layer = 2 * s * (h * h + 2 * h * kv + h * h + 3 * h * ffn) + attn
    base = BASE_LAYERS * base_layer + 2 * s * h * shape["vocab"]
    if method == "dflash":
        return base + dflash_draft_flops(shape, s)
    # the first draft layer's q/k/v read cat(embedding, hidden): 2h inputs
    draft_layer = 2 * s * (2 * h * h + 2 * 2 * h * kv + h * h + 3 * h * ffn) + attn
    draft_step = draft_layer + 2 * s * h * shape["draft_vocab"]
    fc = 2 * s * 3 * h * h
    return base + 3 * (fc + TTT_STEPS * draft_step)


def dflash_draft_flops(shape: dict, s: int) -> float:
    """The DFlash draft's part: fc over the captured layers and the context keys/values for
    all s positions; queries, block keys/values and MLP for the n = anchors x 16 block
    positions; attention over the context before each anchor (anchors spread over the
    second half: 3s/4 on average) and the block; the frozen output layer over the 15 scored
    positions of each block (forward and the input gradient only)."""
    h, ffn, v = shape["hidden"], shape["ffn"], shape["vocab"]
    kv = h // shape["heads"] * shape["kv_heads"]
    n = dflash_anchors(s) * DFLASH_BLOCK
    context = 2 * s * (BASE_LAYERS * h * h + 2 * h * kv)
    block = 2 * n * (2 * h * h + 2 * h * kv + 3 * h * ffn) + 2 * 2 * n * (0.75 * s + DFLASH_BLOCK) * h
    head = 2 * dflash_anchors(s) * (DFLASH_BLOCK - 1) * h * v
    return 3 * (context + block) + 2 * head


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measured_matmul_rate(device, n: int) -> float:
    """bf16 FLOP/s of one n x n x n product (mean of 10 after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 10 * 2 * n ** 3 / (time.perf_counter() - start)


def build(shape: dict, dtype: torch.dtype, method: str, seq: int):
    from transformers import LlamaConfig

    from megatron_specdec.models.provider import build_model
    from megatron_specdec.models.speculative import convert
    from megatron_specdec.training.optimizer import DraftOptimizer

    hf = LlamaConfig(num_hidden_layers=BASE_LAYERS, hidden_size=shape["hidden"],
                     num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                     intermediate_size=shape["ffn"], vocab_size=shape["vocab"],
                     max_position_embeddings=8192, tie_word_embeddings=False,
                     rope_theta=500000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    base = build_model(hf, dtype=dtype, perform_initialization=False)
    with torch.no_grad():  # a uniform fill: megatron's initialisation of 8B shapes is slow
        for p in base.parameters():
            p.uniform_(-0.02, 0.02) if p.dim() > 1 else p.fill_(1.0)
    if method == "dflash":
        config = {"block_size": DFLASH_BLOCK, "num_layers": 1, "anchors_per_sequence": dflash_anchors(seq)}
    else:
        config = {"draft_vocab_size": shape["draft_vocab"], "ttt_steps": TTT_STEPS, "eagle_num_layers": 1,
                  "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    model = convert(base, method, config, hf_config=hf)
    params = [p for p in model.parameters() if p.requires_grad]
    opt_cfg = SimpleNamespace(lr=1e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                              weight_decay=0.0, clip_grad=1.0)
    return model, DraftOptimizer(params, opt_cfg, dtype), hf


def run_seq(model, opt, hf, shape: dict, s: int, steps: int, device, profile_rows: int,
            out_dir: Path, method: str) -> dict:
    ids = torch.randint(0, hf.vocab_size, (1, s), device=device)
    loss_mask = torch.zeros(1, s, dtype=torch.long, device=device)
    loss_mask[:, s // 2:] = 1

    def step():
        opt.zero_grad()
        out = model(ids, loss_mask)
        opt.scale_loss(out["loss_sum"]).backward()
        opt.step(1e-4)

    step()  # warm-up: allocator, kernels' first launch, AdamW state
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    row = {"seq": s, "seconds_per_step": seconds, "tokens_per_s": s / seconds,
           "scored_tokens_per_s": (s - s // 2) / seconds,
           "model_tflop_per_step": step_flops(shape, s, method) / 1e12}
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        row["peak_rss_gib"] = _status_kib("VmHWM") / 2**20
    if profile_rows:
        tag = "" if method == "eagle3" else method + "_"
        row["profile"] = profile(step, device, profile_rows, out_dir / f"train_step_{tag}profile_s{s}.txt")
    return row



def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def profile(step, device, rows: int, path: Path) -> list:
    """The costliest kernels (device time on a GPU, CPU time otherwise) of one step, as a table
    in `path` and as [name, ms, share] rows."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        step()
        _sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    path.write_text(averages.table(sort_by=key, row_limit=rows))
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(averages, key=lambda e: getattr(e, attr, 0.0), reverse=True)
    total = sum(getattr(e, attr, 0.0) for e in averages) or 1.0
    return [[e.key, getattr(e, attr, 0.0) / 1e3, getattr(e, attr, 0.0) / total] for e in events[:rows]]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--method", choices=["eagle3", "dflash"], default="eagle3")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--profile", type=int, default=15, metavar="ROWS",
                   help="profile one more step and keep its costliest ROWS kernels (0: no profile)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/train_step_<device>.json)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron_specdec import distributed

    distributed.initialize(1, 1)
    device = distributed.device()
    tag = "" if args.method == "eagle3" else args.method + "_"
    out = Path(args.out or ROOT / "bench" / "results" / f"train_step_{tag}{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    dtype = torch.bfloat16
    model = None
    name = torch.cuda.get_device_name() if device.type == "cuda" else _cpu_model()
    draft = {"ttt_steps": TTT_STEPS} if args.method == "eagle3" else {"block_size": DFLASH_BLOCK}
    meta = {"what": __doc__.split("\n\n")[0], "method": args.method,
            "shape": {**shape, "base_layers": BASE_LAYERS, **draft, "dtype": "bfloat16"},
            "device": name, "torch": torch.__version__, "commit": _commit(),
            "date": time.strftime("%Y-%m-%d"), "data_sheet_bf16_peak_tflops": None,
            "measured_matmul_tflops": None}
    peak = data_sheet_peak(name) if device.type == "cuda" else None
    if device.type == "cuda":
        meta["data_sheet_bf16_peak_tflops"] = peak / 1e12 if peak else None
        meta["measured_matmul_tflops"] = measured_matmul_rate(device, 8192) / 1e12
    rows = []
    for s in args.seqs:
        if model is None or args.method == "dflash":  # DFlash's anchor count follows s
            model = opt = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model, opt, hf = build(shape, dtype, args.method, s)
        row = run_seq(model, opt, hf, shape, s, args.steps, device, args.profile, out.parent, args.method)
        flops = row["model_tflop_per_step"] * 1e12
        row["achieved_tflops"] = flops / row["seconds_per_step"] / 1e12
        if peak:
            row["mfu"] = flops / row["seconds_per_step"] / peak
        rows.append(row)
        _write(out, meta, rows)
        mem = row.get("peak_memory_gib", row.get("peak_rss_gib"))
        print(f"s={s:5d}  {row['seconds_per_step'] * 1e3:9.1f} ms/step  {row['tokens_per_s']:10.0f} tokens/s  "
              f"{row['achieved_tflops']:8.2f} TFLOP/s  MFU {row.get('mfu', float('nan')):6.1%}  "
              f"peak {mem:6.2f} GiB", flush=True)
    print(f"{name}: wrote {out}")


def _write(path: Path, meta: dict, rows: list):
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    tmp.replace(path)


def _cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()

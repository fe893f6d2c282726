"""Conversion time and peak memory. SmolLM2-135M-Instruct (float32) and llama1b, a random
Llama-3.2-1B-shaped model (1.24B parameters: hidden 2048, 16 layers, 32/8 heads, ffn 8192,
vocabulary 128256, tied; written here as bf16 safetensors in a temporary directory): HF ->
Megatron at TP=1 and TP=2, and back to HF from each checkpoint. Each conversion runs as its
own command-line process (TP=2 spawns 2 ranks); peak memory is the largest total RSS of the
process tree, and of its largest process (a rank).

    python bench/bench_conversion.py [--models smollm2 llama1b] [--code DIR --label NAME]
                                     [--export-code DIR --export-label NAME] [--draft CKPT]

`--code` runs the converters of another checkout (e.g. a `git worktree` of an earlier
commit) for a before/after table; `--export-code` also exports each checkpoint with another
checkout's converter (the import runs once). `--draft` exports the draft of a speculative
checkpoint (export_draft.py) with each checkout. Rows are merged into
bench/results/conversion.json by (model, label, direction, TP).
"""

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_peak import measure  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0,
                rms_norm_eps=1e-5)


def write_random_hf(out: Path, config, shapes: dict) -> Path:
    """An HF directory of `config` with random bf16 tensors of `shapes` ({name: shape}),
    written one tensor at a time (a model larger than memory never exists whole)."""
    from megatron_specdec.checkpointing import hf_files as files

    gen = torch.Generator().manual_seed(0)
    specs = [(name, shape, torch.bfloat16) for name, shape in shapes.items()]
    stream = ((name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
              for name, shape in shapes.items())
    out.mkdir(parents=True)
    config.save_pretrained(out)
    files.write_safetensors(out / files.HF_WEIGHTS, specs, stream, metadata={"format": "pt"})
    return out


def write_random_llama(out: Path) -> Path:
    """A random bf16 Llama of LLAMA_1B's shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA_1B, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()
                  if k != "lm_head.weight"}
    return write_random_hf(out, config, shapes)


def convert(codes, tmp: Path, model: str, hf_dir, tp: int, dtype: str):
    """Import with the first of `codes` [(label, checkout)], then export the checkpoint with
    each of them."""
    ckpt = tmp / f"{model}_tp{tp}"
    runs = [(codes[0], "hf_to_megatron", ["checkpoint_tools/hf_to_megatron.py", "--model",
                                          hf_dir, "--out", ckpt, "--tp", str(tp),
                                          "--dtype", dtype])]
    runs += [(code, "megatron_to_hf", ["checkpoint_tools/megatron_to_hf.py", "--model", ckpt,
                                       "--out", tmp / f"{model}_hf{tp}_{i}"])
             for i, code in enumerate(codes)]
    return [run(code, model, direction, tp, dtype, cmd) for code, direction, cmd in runs]


def run(code, model, direction, tp, dtype, cmd):
    label, path = code
    env = dict(os.environ, PYTHONPATH=str(path))  # ahead of the installed (editable) package
    seconds, tree, one = measure([sys.executable, path / cmd[0], *cmd[1:]], env=env)
    row = {"model": model, "direction": direction, "tp": tp, "dtype": dtype, "label": label,
           "seconds": seconds, "peak_rss_mib": tree, "peak_rss_per_process_mib": one,
           "load_avg": os.getloadavg()[0]}
    print(row, flush=True)
    return row


def main():
    from megatron_specdec.models.default_model import default_model_dir

    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["smollm2", "llama1b"])
    p.add_argument("--code", type=Path, default=REPO, help="checkout whose converters run")
    p.add_argument("--label", default="now")
    p.add_argument("--tps", nargs="+", type=int, default=[1, 2])
    p.add_argument("--export-code", type=Path, help="checkout whose megatron_to_hf also runs")
    p.add_argument("--export-label", default="before")
    p.add_argument("--draft", type=Path, help="speculative checkpoint whose draft is exported")
    args = p.parse_args()
    codes = [(args.label, args.code.resolve())]
    if args.export_code:
        codes.append((args.export_label, args.export_code.resolve()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.draft:
            rows += [run(code, args.draft.name, "export_draft", 0, "as saved",
                         ["checkpoint_tools/export_draft.py", "--model", args.draft.resolve(),
                          "--out", tmp / f"draft_{i}"]) for i, code in enumerate(codes)]
        for model in args.models:
            if model == "smollm2":
                hf_dir, dtype = default_model_dir(), "float32"
            else:
                hf_dir, dtype = write_random_llama(tmp / "llama1b"), "bfloat16"
            for tp in args.tps:
                rows += convert(codes, tmp, model, hf_dir, tp, dtype)
                for old in tmp.glob(f"{model}_*"):  # free the disk before the next run
                    shutil.rmtree(old.resolve())  # checkpoints are links to versioned dirs
                    old.unlink(missing_ok=True)
    print(f"{'model':<13}{'label':<12}{'direction':<16}{'TP':>4}{'seconds':>10}"
          f"{'peak RSS MiB':>14}{'per process':>13}")
    for r in rows:
        print(f"{r['model']:<13}{r['label']:<12}{r['direction']:<16}{r['tp']:>4}"
              f"{r['seconds']:>10.1f}{r['peak_rss_mib']:>14.0f}"
              f"{r['peak_rss_per_process_mib']:>13.0f}")
    out = REPO / "bench" / "results" / "conversion.json"
    result = json.loads(out.read_text()) if out.is_file() else {}
    key = lambda r: (r.get("model", "smollm2"), r.get("label", "now"), r["direction"], r["tp"])  # noqa: E731
    new = {key(r) for r in rows}
    for r in result.get("rows", []):  # rows of the format before `model` and `label`
        r.setdefault("model", "smollm2"), r.setdefault("dtype", result.get("dtype", "float32"))
        r.setdefault("label", "whole-tensor reads (earlier run)")
    result["rows"] = [r for r in result.get("rows", []) if key(r) not in new] + rows
    result.update({"cpus": torch.get_num_threads(), "torch": torch.__version__,
                   "machine": platform.processor() or platform.machine(),
                   "note": "wall time includes process start-up and imports (~8 s per process); "
                           "the 2-core machine is shared (load_avg per row)"})
    result.pop("model", None), result.pop("dtype", None)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

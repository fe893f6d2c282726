"""Soak: N optimizer steps of a training recipe in this process while sampling, after every
step, the resident memory (RSS), glibc's heap (mallinfo2), the Python heap (allocated blocks;
tracemalloc's traced bytes with --tracemalloc, which slows Python) and the step's wall and
CPU time. Reports the growth from step --from-step to the end as slopes of a least-squares
line (MB and ms per 100 steps) and as the relative change of the line's value, and writes the
JSON (rewritten every --flush steps, so a cut-off run keeps what it measured) and a plot.

    python bench/bench_soak.py --name soak_bf16_seq128 --config recipes/eagle3_smollm2.yaml \\
        data.seq_length=128 training.global_batch_size=1 training.steps=1000

Wall time per step moves with whatever else the machine runs; CPU time per step (this
process, all threads) moves much less, so both are reported. The first step's times include
the set-up.

`--kernel bf16|float32` soaks only the linear layers of SmolLM2's decoder (its four weight
shapes, forward and backward) over row counts drawn like a step's length, 1 to
data.seq_length, rounded up to data.length_bucket: the growth without the model around it.

    python bench/bench_soak.py --name soak_kernel_bf16_bucket1 --kernel bf16 \
        data.seq_length=512 data.length_bucket=1 training.steps=600

`--generate N` soaks generation instead: the recipe's model (model.path, model.dtype) answers
N GSM8K questions one after another with the n-gram drafter (speculative verify forwards of a
new length every round, no trained draft needed), --new-tokens each at most, a record after
each answer. Prompts are padded to a multiple of --prompt-bucket tokens (generation.left_pad;
1: the exact lengths, as before the bucket).

    python bench/bench_soak.py --name soak_generate_ngram_bf16 --generate 600

`--regenerate N` soaks data regeneration (data.regenerate with the Megatron backend, as
`python -m megatron_specdec.cli.data regenerate` runs it): N GSM8K questions answered greedily
in batches of --batch-size, a record after each batch.

    python bench/bench_soak.py --name soak_generate_regenerate_bf16 --regenerate 1000"""

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Quiet, cheap and checkpoint-free unless the command line says otherwise.
SOAK_DEFAULTS = ["logging.progress_bar=false", "logging.tensorboard=false",
                 "logging.interval=50", "evaluation.interval=0", "checkpointing.interval=0",
                 "checkpointing.resume=false"]


# The allocator and kernel-cache settings a figure depends on (LRU_CACHE_CAPACITY: ideep's
# primitive cache in torch's mkldnn ops; ONEDNN_PRIMITIVE_CACHE_CAPACITY: oneDNN's own).
ENV_KEYS = ("MALLOC_ARENA_MAX", "LD_PRELOAD", "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
            "LRU_CACHE_CAPACITY")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo():
    """glibc's mallinfo2 (None where the C library has none, e.g. musl or jemalloc preloaded
    without it)."""
    try:
        libc = ctypes.CDLL(None)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """The per-step record: called by the trainer after each step."""

    def __init__(self, out: Path, meta: dict, flush: int, trace: bool):
        self.out, self.meta, self.flush, self.trace = out, meta, flush, trace
        self.mallinfo = _mallinfo()
        self.rows = []
        self.last = (time.perf_counter(), time.process_time())

    def __call__(self, step: int):
        wall, cpu = time.perf_counter(), time.process_time()
        row = {"step": step, "wall_s": wall - self.last[0], "cpu_s": cpu - self.last[1],
               "rss_mb": rss_bytes() / 2**20, "py_blocks": sys.getallocatedblocks()}
        if self.mallinfo is not None:
            m = self.mallinfo()
            row["heap_mb"] = (m.arena + m.hblkhd) / 2**20  # obtained from the OS (brk + mmap)
            row["heap_used_mb"] = (m.uordblks + m.hblkhd) / 2**20
        if self.trace:
            row["py_traced_mb"] = tracemalloc.get_traced_memory()[0] / 2**20
        self.rows.append(row)
        if step % self.flush == 0:
            self.write()
        self.last = (time.perf_counter(), time.process_time())

    def write(self, summary=None):
        doc = dict(self.meta, analysis=analyse(self.rows, self.meta["from_step"]),
                   summary=summary, steps=self.rows)
        tmp = self.out.with_name(f".{self.out.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.out)


def _line(xs, ys):
    """Least-squares slope and intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return slope, my - slope * mx


def analyse(rows: list, from_step: int) -> dict:
    """Per quantity: slope per 100 steps from `from_step` on, the fitted line's value at
    `from_step` and at the end, their relative change, and the first/last 50-step medians."""
    tail = [r for r in rows if r["step"] >= from_step]
    if len(tail) < 10:
        return {}
    out = {"from_step": from_step, "to_step": tail[-1]["step"]}
    for key, scale, unit in (("rss_mb", 1, "MB"), ("heap_mb", 1, "MB"),
                             ("py_blocks", 1, "blocks"), ("py_traced_mb", 1, "MB"),
                             ("wall_s", 1000, "ms"), ("cpu_s", 1000, "ms")):
        if key not in tail[0]:
            continue
        xs = [r["step"] for r in tail]
        ys = [r[key] * scale for r in tail]
        slope, icpt = _line(xs, ys)
        start, end = icpt + slope * xs[0], icpt + slope * xs[-1]
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        out[key] = {f"slope_{unit}_per_100_steps": slope * 100,
                    "fit_start": start, "fit_end": end,
                    "growth_pct": 100 * (end - start) / start if start else None,
                    "median_first_50": med(ys[:50]), "median_last_50": med(ys[-50:])}
    return out


def plot(doc: dict, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_specdec.evaluation.plots import save_figure

    rows = doc["steps"]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(steps, [r["rss_mb"] for r in rows], label="RSS")
    if "heap_mb" in rows[0]:
        axes[0].plot(steps, [r["heap_mb"] for r in rows], label="glibc heap (arena+mmap)")
    axes[0].set_ylabel("MB")
    axes[0].legend()
    axes[1].plot(steps, [1000 * r["wall_s"] for r in rows], lw=0.5, label="wall")
    axes[1].plot(steps, [1000 * r["cpu_s"] for r in rows], lw=0.5, label="CPU (all threads)")
    axes[1].set_ylabel("ms / step")
    axes[1].legend()
    axes[2].plot(steps, [r["py_blocks"] for r in rows])
    axes[2].set_ylabel("Python heap blocks")
    axes[2].set_xlabel("step")
    fig.suptitle(f"{doc['name']} ({doc['cpu']}, {doc['commit']})", fontsize=9)
    fig.tight_layout()
    save_figure(fig, png, dpi=80)


# SmolLM2-135M's decoder linears (in, out): fused QKV (9 + 2x3 heads of 64), attention
# output, gated MLP up (2 x 1536), MLP down.
KERNEL_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def kernel_soak(dtype_name: str, recipe, sampler, seed: int = 0):
    """`recipe.training.steps` forward+backward passes through KERNEL_SHAPES weights."""
    import random

    import torch

    from megatron_specdec.training.batches import bucketed

    dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    rng = random.Random(seed)
    weights = [(torch.randn(o, i, dtype=dtype) / i ** 0.5).requires_grad_()
               for i, o in KERNEL_SHAPES]
    seq, bucket = recipe.data.seq_length, recipe.data.length_bucket
    for step in range(1, recipe.training.steps + 1):
        rows = bucketed(rng.randint(1, seq), bucket, seq)
        x = torch.randn(rows, 576, dtype=dtype)
        h = (x @ weights[0].T)[:, :576] @ weights[1].T  # the query part stands for attention
        up = h @ weights[2].T
        out = (up[:, :1536] * torch.nn.functional.silu(up[:, 1536:])) @ weights[3].T
        out.float().square().mean().backward()
        for w in weights:
            w.grad = None
        sampler(step)


def generation_soak(recipe, sampler, prompts: int, new_tokens: int, bucket: int):
    """`prompts` GSM8K questions (data/sources), each answered by speculative generation with
    the n-gram drafter on the recipe's model."""
    import torch

    from megatron_specdec import convert, distributed, load_model
    from megatron_specdec.data import load_tokenizer
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.checkpointing.checkpoint import dtype_from_name

    distributed.initialize(1, 1)
    loaded = load_model(recipe.model.path, dtype_from_name(recipe.model.dtype))
    model = convert(loaded.model, "medusa", {"medusa_num_heads": 1}, loaded.hf_config).eval()
    tokenizer = load_tokenizer(str(loaded.tokenizer_dir))
    generator = SpeculativeGenerator(model, drafter_kind="ngram", prompt_bucket=bucket)
    with open(ROOT / "data" / "sources" / "gsm8k_train.jsonl") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(prompts), f)]
    eos = (tokenizer.eos_token_id,)
    with torch.inference_mode():
        for step, question in enumerate(questions, 1):
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            generator.generate(ids, new_tokens, eos)
            sampler(step)


class _SampledBackend:
    """A generation backend that records a soak step after each batch it answers."""

    def __init__(self, backend, sampler):
        self.backend, self.sampler, self.batches = backend, sampler, 0

    def generate(self, prompts, max_new_tokens, messages=None):
        out = self.backend.generate(prompts, max_new_tokens, messages)
        self.batches += 1
        self.sampler(self.batches)
        return out


def regeneration_soak(recipe, sampler, prompts: int, new_tokens: int, bucket: int,
                      batch_size: int, out_path: Path):
    """`prompts` GSM8K questions answered by data.regenerate through the Megatron backend
    (the recipe's model and dtype), a record after each batch."""
    from megatron_specdec.data.regenerate import regenerate
    from megatron_specdec.data.sources import read_sources
    from megatron_specdec.inference.data_backend import MegatronBackend

    backend = MegatronBackend(recipe.model.path, dtype=recipe.model.dtype, prompt_bucket=bucket)
    rows = read_sources(["gsm8k"], ROOT / "data" / "sources")[:prompts]
    return regenerate(rows, _SampledBackend(backend, sampler), backend.tokenizer, out_path,
                      batch_size, new_tokens, progress=False)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                            "megatron_specdec"], capture_output=True, text=True).stdout.strip()
    return out + ("+uncommitted" if dirty else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="what is measured: bench/results/<name>.json")
    p.add_argument("--config", default=str(ROOT / "recipes/eagle3_smollm2.yaml"))
    p.add_argument("--from-step", type=int, default=100,
                   help="growth is measured from this step to the end (warm-up excluded)")
    p.add_argument("--flush", type=int, default=25, help="rewrite the JSON every N steps")
    p.add_argument("--tracemalloc", action="store_true", help="also trace Python allocations")
    p.add_argument("--output-dir", help="the run's output_dir (default: a temporary one)")
    p.add_argument("--plot-only", action="store_true",
                   help="analyse again (with --from-step) and redraw from the JSON, e.g. of a run "
                        "that was cut off")
    p.add_argument("--kernel", choices=("bf16", "float32"),
                   help="soak SmolLM2's linear layers alone in this dtype (no model, no data)")
    p.add_argument("--generate", type=int, metavar="N",
                   help="soak generation over N prompts instead of training (see above)")
    p.add_argument("--regenerate", type=int, metavar="N",
                   help="soak data regeneration over N prompts instead of training (see above)")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="--generate/--regenerate: tokens per answer at most")
    p.add_argument("--prompt-bucket", type=int, default=None,
                   help="--generate/--regenerate: prompts padded to a multiple of this many "
                        "tokens (default: generation.PROMPT_BUCKET; 1: exact lengths)")
    p.add_argument("--batch-size", type=int, default=4,
                   help="--regenerate: prompts answered together")
    p.add_argument("overrides", nargs="*", help="recipe key=value overrides")
    args = p.parse_args(argv)
    out = ROOT / "bench" / "results" / f"{args.name}.json"
    png = out.with_suffix(".png")
    if args.plot_only:
        doc = json.loads(out.read_text())
        doc.update(from_step=args.from_step, analysis=analyse(doc["steps"], args.from_step))
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out)
        plot(doc, png)
        print(json.dumps(doc["analysis"], indent=1))
        return
    import torch

    from megatron_specdec import distributed
    from megatron_specdec.training import dtype_choice, load_recipe, train

    workdir = args.output_dir or tempfile.mkdtemp(prefix="soak_")
    overrides = SOAK_DEFAULTS + [f"output_dir={workdir}"] + list(args.overrides)
    recipe = load_recipe(args.config, overrides)
    dtype_choice.resolve(recipe)  # the dtype the soak records is the one it ran
    meta = {"name": args.name, "config": os.path.relpath(args.config, ROOT),
            "overrides": list(args.overrides), "cpu": _cpu_model(), "commit": _commit(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "torch_threads": torch.get_num_threads(),
            "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
            "load_average_start": os.getloadavg(), "from_step": args.from_step}
    if args.tracemalloc:
        tracemalloc.start()
    sampler = Sampler(out, meta, args.flush, args.tracemalloc)
    if args.kernel:
        meta["kernel"] = args.kernel
        kernel_soak(args.kernel, recipe, sampler)
        summary = {"steps": recipe.training.steps}
    elif args.generate or args.regenerate:
        from megatron_specdec.inference.generation import PROMPT_BUCKET

        bucket = PROMPT_BUCKET if args.prompt_bucket is None else args.prompt_bucket
        meta.update(generate=args.generate, regenerate=args.regenerate,
                    new_tokens=args.new_tokens, prompt_bucket=bucket,
                    model_dtype=recipe.model.dtype)
        try:
            if args.generate:
                generation_soak(recipe, sampler, args.generate, args.new_tokens, bucket)
                summary = {"steps": args.generate}
            else:
                meta["batch_size"] = args.batch_size
                stats = regeneration_soak(recipe, sampler, args.regenerate, args.new_tokens,
                                          bucket, args.batch_size,
                                          Path(workdir) / "regenerated.jsonl")
                summary = {"steps": len(sampler.rows), "rows": stats.written,
                           "completion_tokens": stats.completion_tokens,
                           "seconds_this_run": stats.seconds}
        finally:
            distributed.destroy()
    else:
        try:
            summary = train(recipe, on_step=sampler)
        finally:
            distributed.destroy()
    meta["load_average_end"] = os.getloadavg()
    sampler.write({k: summary[k] for k in ("steps", "final_loss", "seconds_this_run", "rows",
                                           "completion_tokens") if k in summary})
    plot(json.loads(out.read_text()), png)
    print(json.dumps(analyse(sampler.rows, args.from_step), indent=1))


if __name__ == "__main__":
    main()

"""Generation speed against what a user would run instead, side by side in one process.

For each MT-bench prompt (first turn, chat template; batch 1, greedy) every method below
generates up to --max-new-tokens, prompt by prompt in turn (in reverse order every other
prompt, so no method always runs right after the same one), so drift in the machine's speed
hits all of them alike:

- transformers `generate` greedy, and with prompt lookup (`prompt_lookup_num_tokens=10`),
  on the same SmolLM2 weights (the outside anchors);
- the project's plain greedy (`generation.plain_generate`);
- the project's speculative generation: the draft module with a fixed chain of k and with the
  adaptive draft length (default), optionally a tree, and n-gram (prompt lookup) drafting;
  with --draft-model, a separate GPT of the same vocabulary drafting (fixed k and adaptive),
  and with --draft-model-hf (its `megatron_to_hf` export) transformers' assisted generation
  (`assistant_model=`, a constant k = --num-draft-tokens or 3) with the same pair; its
  acceptance length is tokens per target forward.

- with --also-model CKPT (a speculative checkpoint of another draft method over the same
  base, e.g. a DFlash draft beside an EAGLE3 one), its draft's fixed-k and adaptive rows in
  the same loop, and its sampling row;
- vLLM's CPU build (when `make vllm-env` made `.venv-vllm`): greedy, n-gram (k=3) and, with
  --vllm-eagle3 DIR / --vllm-dflash DIR, that method with that HF draft (e.g.
  models/eagle3_smollm2; k = --num-draft-tokens, else 3), in its own process on the same
  prompts and stopping at the same end-of-turn ids (engines/vllm_client.py); with
  --draft-model-hf also vLLM's draft model (`"method": "draft_model"`) with that export.

Reports tokens/s, the ratio to transformers greedy and to project greedy, acceptance length
(tokens per base forward), how many outputs equal the project's greedy output, where a
speculative run's time goes (drafting, base forwards, the rest), and acceptance length per
category. Each row's fraction of the batch-1 bandwidth bound is given twice: against the read
rate measured once before the runs (`of_bandwidth_bound`), and against the rate sampled right
before and after each of its prompts (`of_bound_during_run`: the time its tokens would take at
the bound of the two samples' mean over the time they took; vLLM's rows, one process for all
of them, take the mean of a sample before and after it), because a shared machine's read rate
can move twofold from minute to minute over an hour's run. Then, on the same prompts: plain
greedy throughput at each --batch-sizes (project vs transformers, left-padded batches), and
sampling at --temperature (transformers, project plain, project speculative with the draft and
with n-gram). Table on stdout, JSON in bench/results/generation.json (plot beside it).

    python bench/bench_generation.py --data data/sources/mt_bench.jsonl [--num-prompts 16]
        [--max-new-tokens 128] [--model CKPT | --algo eagle3|medusa] [--num-draft-tokens K]
        [--tree-top-k T [--tree-max-nodes N]] [--every N] [--batch-sizes 4 16]
        [--temperature 0.7] [--drafter draft_model --draft-model DRAFT_CKPT]
        [--also-model CKPT] [--vllm-eagle3 models/eagle3_smollm2] [--vllm-dflash DIR]
        [--vllm-peagle DIR]
        [--methods 'eagle3 adaptive' 'vllm greedy' ...]

Without --model the draft is a randomly initialised one on the embedded SmolLM2 (what
`convert` gives before training): it accepts almost nothing, so the fixed-k run measures the
cost of drafting and verifying, and the adaptive run whether the policy falls back to plain
decoding when drafts do not pay.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from bench_linear import ReadProbe, describe_machine

from megatron_specdec import distributed
from megatron_specdec.evaluation.plots import save_figure

RESULTS = Path(__file__).resolve().parent / "results" / "generation.json"
# Plain greedy with every decoding linear as `W @ x.T`: the fixed choice before measurement.
PREVIOUS = "project greedy (W @ x.T pinned)"


def build(args):
    """(speculative model, HF model directory of the same base, description) at TP=PP=1."""
    from megatron_specdec import convert
    from megatron_specdec.models.default_model import default_model_dir
    from megatron_specdec.loading.hf_conversion import model_from_hf
    from megatron_specdec.loading.speculative import load_speculative

    if args.model:
        model, _, _ = load_speculative(args.model)
        # The transformers rows load this directory: the checkpoint's tokenizer directory
        # holds no model, so the HF base it was converted from (as vLLM serves it).
        return model, vllm_base(args, None), f"checkpoint {args.model}"
    hf_dir = default_model_dir()
    base, config = model_from_hf(hf_dir)
    torch.manual_seed(0)
    model = convert(base, args.algo, {}, hf_config=config)
    return model, hf_dir, f"SmolLM2-135M-Instruct + random {args.algo} draft (untrained)"


def hf_runner(hf_model, eos, max_new_tokens, **kwargs):
    """tokens of transformers `generate` (greedy, or with the given assistant settings)."""
    from megatron_specdec.evaluation.transformers_baseline import hf_generate

    return lambda ids: (hf_generate(hf_model, ids, max_new_tokens, eos, **kwargs), None)


def method_name(model) -> str:
    """A row's name for a speculative model's draft: its method, "peagle" for a
    parallel-drafting EAGLE3 draft (another design over the same method)."""
    return "peagle" if getattr(model.spec_config, "parallel_drafting", False) else model.algo


def load_also(args, model):
    """The --also-model speculative checkpoints, each over the same base as --model (its
    rows name it by its method, so two of one method are refused)."""
    from megatron_specdec.loading.speculative import load_speculative

    others = []
    for path in args.also_model:
        other = load_speculative(path)[0].eval()
        if method_name(other) in {method_name(model), *(method_name(o) for o in others)}:
            raise SystemExit(f"--also-model {path}: a {method_name(other)} draft, a method already "
                             f"benchmarked here (one checkpoint per method)")
        mine, theirs = (next(m.base.parameters()).dtype for m in (model, other))
        if other.vocab_size != model.vocab_size or mine != theirs:
            raise SystemExit(f"--also-model {path}: a base of vocabulary {other.vocab_size} in "
                             f"{theirs}, --model's is {model.vocab_size} in {mine} (expected "
                             f"the same base: import both drafts onto one base checkpoint)")
        others.append(other)
    return others


def methods(args, model, hf_dir, eos, tree, others=()):
    """({name -> run(prompt ids) -> (tokens, GenerationResult or None)}, the HF model)."""
    from megatron_specdec.evaluation.transformers_baseline import load_transformers
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate

    hf_model = load_transformers(hf_dir)
    n = args.max_new_tokens
    runs = {
        "transformers greedy": hf_runner(hf_model, eos, n),
        "transformers prompt lookup": hf_runner(hf_model, eos, n, prompt_lookup_num_tokens=10),
        **assisted_runs(args, hf_dir, type(hf_model), eos),
        "project greedy": lambda ids: (
            plain_generate(model.base, [ids], n, model.vocab_size, eos)[0], None),
        PREVIOUS: pinned("weight_left", lambda ids: (
            plain_generate(model.base, [ids], n, model.vocab_size, eos)[0], None)),
    }
    name = method_name(model)
    drafts = {f"{name} fixed k": SpeculativeGenerator(model, args.num_draft_tokens,
                                                      policy="fixed"),
              f"{name} adaptive": SpeculativeGenerator(model, args.num_draft_tokens),
              "ngram": SpeculativeGenerator(model, args.num_draft_tokens, drafter_kind="ngram")}
    if tree is not None:
        drafts[f"{name} tree"] = SpeculativeGenerator(model, args.num_draft_tokens,
                                                            tree=tree)
    for other in others:
        drafts[f"{method_name(other)} fixed k"] = SpeculativeGenerator(
            other, args.num_draft_tokens, policy="fixed")
        drafts[f"{method_name(other)} adaptive"] = SpeculativeGenerator(
            other, args.num_draft_tokens)
    drafts.update(draft_model_generators(args, model, {"fixed k": "fixed",
                                                       "adaptive": "adaptive"}))
    for name, generator in drafts.items():
        runs[name] = spec_runner(generator, n, eos)
    return runs, hf_model


def pinned(product, run):
    """`run` with every decoding linear on `product` (models/layers/linear_kernels.PIN_ENV), the
    measured choice restored after it."""
    from megatron_specdec.models.layers import linear_kernels

    def call(ids):
        os.environ[linear_kernels.PIN_ENV] = product
        linear_kernels.reset()
        try:
            return run(ids)
        finally:
            del os.environ[linear_kernels.PIN_ENV]
            linear_kernels.reset()

    return call


def read_bytes_per_token(model) -> int:
    """Bytes of the base's weights a batch-1 decode step reads (the tied embedding once, as
    the output layer)."""
    return sum(p.numel() * p.element_size() for p in model.base.parameters())


def counted(cls):
    """A subclass of the HF model class `cls` that counts its forward calls (class-wide)."""
    class Counted(cls):
        calls = 0

        def forward(self, *args, **kwargs):
            Counted.calls += 1
            return super().forward(*args, **kwargs)

    return Counted


def assisted_runs(args, hf_dir, model_class, eos):
    """{"transformers assisted (draft model)": run} with --draft-model-hf, else {}: the
    target (fp32, its forward calls counted) with the exported draft model (fp32 too: bf16
    matmuls are slower on this CPU) as `assistant_model`."""
    from transformers import AutoModelForCausalLM

    if args.draft_model_hf is None:
        return {}
    if args.draft_model is None:
        raise SystemExit("--draft-model-hf goes with --drafter draft_model --draft-model CKPT "
                         "(the checkpoint it was exported from)")
    if not (Path(args.draft_model_hf) / "config.json").is_file():
        raise SystemExit(f"--draft-model-hf {args.draft_model_hf}: no config.json there "
                         f"(expected an HF directory, as megatron_to_hf writes)")
    target = counted(model_class).from_pretrained(hf_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft_model_hf,
                                                 dtype=torch.float32).eval()
    k = args.num_draft_tokens or 3
    run = hf_runner(target, eos, args.max_new_tokens, assistant_model=draft,
                    num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0)
    run.target = target
    return {ASSISTED: run}


ASSISTED = "transformers assisted (draft model)"


def draft_model_generators(args, model, policies):
    """{"draft-model <name>": generator} for each {name: policy}, sharing one loaded draft
    model; none without --draft-model."""
    from megatron_specdec.inference.generator import SpeculativeGenerator, build_drafter

    if args.draft_model is None:
        return {}
    drafter = build_drafter(model, "draft_model", args.draft_model)
    return {f"draft-model {name}": SpeculativeGenerator(
        model, args.num_draft_tokens, policy=policy, drafter_kind="draft_model",
        drafter=drafter) for name, policy in policies.items()}


def spec_runner(generator, max_new_tokens, eos):
    def run(ids):
        result = generator.generate(ids, max_new_tokens, eos)
        return result.tokens, result
    return run


def main():
    from megatron_specdec.checkpointing.checkpoint import write_text_atomic
    from megatron_specdec.cli.common import setup_logging

    setup_logging()  # quiet logs: benign library warnings off
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True,
                   help="MT-bench jsonl (e.g. data/sources/mt_bench.jsonl)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--every", type=int, default=5,
                   help="take every N-th question (5 over MT-bench's 80: 2 per category)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--model", default=None, help="speculative checkpoint (default: random draft)")
    p.add_argument("--also-model", nargs="*", default=[],
                   help="speculative checkpoint(s) of other draft methods over the same base: "
                        "their rows beside --model's")
    p.add_argument("--algo", choices=("eagle3", "medusa"), default="eagle3")
    p.add_argument("--drafter", choices=("draft_model",), default=None,
                   help="also run this drafter (beside the draft module and n-gram)")
    p.add_argument("--draft-model", default=None,
                   help="--drafter draft_model: a GPT checkpoint of the target's vocabulary")
    p.add_argument("--draft-model-hf", default=None,
                   help="the HF export of --draft-model (megatron_to_hf): adds transformers' "
                        "assisted generation with the same draft")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="also draft a tree with this branching")
    p.add_argument("--tree-max-nodes", type=int, default=None)
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[4, 16])
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM rows")
    p.add_argument("--vllm-base", default=None,
                   help="HF directory vLLM serves (default: the one --model's base was converted "
                        "from, as its checkpoint records; without --model the embedded SmolLM2)")
    p.add_argument("--vllm-eagle3", default=None,
                   help="HF EAGLE3 draft directory for a vLLM EAGLE3 row (the draft of --model "
                        "as exported, e.g. models/eagle3_smollm2)")
    p.add_argument("--vllm-dflash", default=None,
                   help="HF DFlash draft directory for a vLLM DFlash row (an --also-model or "
                        "--model draft as exported)")
    p.add_argument("--vllm-peagle", default=None,
                   help="HF parallel-drafting EAGLE3 draft directory for a vLLM P-EAGLE row "
                        "(parallel_drafting; an --also-model or --model draft as exported)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling comparison at this temperature (0: skip it)")
    p.add_argument("--sampling-every", type=int, default=1,
                   help="the sampling comparison takes every N-th of the prompts (it runs "
                        "four generators a prompt; 5 over all 80: 2 per category)")
    p.add_argument("--methods", nargs="*", default=None, metavar="NAME",
                   help="run only these rows (names as the table prints them, e.g. "
                        "'eagle3 adaptive' 'vllm greedy'); transformers greedy and project "
                        "greedy always run, as the anchors")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.sampling_every < 1:
        raise SystemExit(f"--sampling-every {args.sampling_every}: expected >= 1")

    from megatron_specdec.data import end_of_turn_ids, load_tokenizer
    from megatron_specdec.inference.metrics import acceptance_summary
    from megatron_specdec.cli.validate import check_draft_model_args, tree_spec
    from megatron_specdec.evaluation.acceptance import read_prompts

    tree = tree_spec(args)
    for flag, path in vllm_drafts(args).items():
        if not (Path(path) / "config.json").is_file():
            raise SystemExit(f"--vllm-{flag} {path}: no config.json there (expected an HF "
                             f"{flag} draft directory, as export_draft writes)")
    distributed.initialize(1, 1)
    model, hf_dir, what = build(args)
    model.eval()
    check_draft_model_args(args, model.vocab_size, hf_dir)
    others = load_also(args, model)
    served_base = None if args.no_vllm else vllm_base(args, hf_dir)
    tokenizer = load_tokenizer(str(hf_dir))
    eos = set(end_of_turn_ids(tokenizer))
    prompts = read_prompts(args.data, tokenizer)[:: args.every][: args.num_prompts]
    runs, hf_model = methods(args, model, hf_dir, eos, tree, others)
    check_methods(args.methods, set(runs) | set(vllm_configs(args)))
    runs = pick(runs, args.methods)
    about = describe_machine()
    read_bytes = read_bytes_per_token(model)
    bound = about["read_bandwidth_gb_s"] * 1e9 / read_bytes
    probe = ReadProbe()
    for run in runs.values():  # first use: the kernel choice measures each new weight shape
        run(prompts[0][1][:16])
    load_before = os.getloadavg()[0]
    stats = {name: {"tokens": 0, "outputs": [], "results": [], "times": [], "read_gb_s": []}
             for name in runs}
    for number, (_, ids) in enumerate(prompts, 1):
        for name in list(runs) if number % 2 else reversed(list(runs)):
            before = probe(3)
            start = time.perf_counter()
            tokens, result = runs[name](ids)
            stats[name]["times"].append(time.perf_counter() - start)
            stats[name]["read_gb_s"].append((before, probe(3)))
            stats[name]["tokens"] += len(tokens)
            stats[name]["outputs"].append(tokens)
            stats[name]["results"].append(result)
        print(f"prompt {number}/{len(prompts)} done", flush=True)

    base = stats["project greedy"]
    rates = {name: s["tokens"] / sum(s["times"]) for name, s in stats.items()}
    hf_rate, own_rate = rates["transformers greedy"], rates["project greedy"]
    report = {}
    for name, s in stats.items():
        rate = rates[name]
        row = {"tokens_per_s": rate, "vs_transformers_greedy": rate / hf_rate,
               "vs_project_greedy": rate / own_rate,
               "identical_to_project_greedy": sum(
                   a == b for a, b in zip(s["outputs"], base["outputs"])),
               "of_bound_during_run": sum(
                   len(out) * read_bytes / (sum(gbs) / 2 * 1e9)
                   for out, gbs in zip(s["outputs"], s["read_gb_s"])) / sum(s["times"]),
               "vs_project_greedy_by_category": speed_by_category(prompts, s, base),
               "vs_transformers_greedy_by_category": speed_by_category(
                   prompts, s, stats["transformers greedy"]),
               # Prompt by prompt, in the order they ran: drift over a long run shows here.
               "per_prompt": [{"category": c, "prompt_tokens": len(ids), "new_tokens": len(out),
                               "seconds": round(t, 4), "read_gb_s_before": round(gbs[0], 1),
                               "read_gb_s_after": round(gbs[1], 1)}
                              for (c, ids), out, t, gbs in zip(prompts, s["outputs"], s["times"],
                                                               s["read_gb_s"])]}
        for entry, r in zip(row["per_prompt"], s["results"]):
            if r is not None:
                entry.update(rounds=len(r.accepted), drafted=sum(r.drafted),
                             accepted=sum(r.accepted))
        results = [r for r in s["results"] if r is not None]
        if results:
            k = results[0].num_draft_tokens
            accepted = [a for r in results for a in r.accepted]
            drafted = [d for r in results for d in r.drafted]
            summary = acceptance_summary(accepted, k, drafted)
            seconds = {part: sum(r.seconds[part] for r in results)
                       for part in ("draft", "base", "total")}
            row.update(acceptance_length=summary["acceptance_length"],
                       mean_drafted=summary["mean_drafted"],
                       time_share={"draft": seconds["draft"] / seconds["total"],
                                   "base_forwards": seconds["base"] / seconds["total"],
                                   "rest": 1 - (seconds["draft"] + seconds["base"])
                                   / seconds["total"]},
                       categories={c: acceptance_summary(
                           [a for (cc, _), r in zip(prompts, s["results"]) if cc == c
                            for a in r.accepted], k,
                           [d for (cc, _), r in zip(prompts, s["results"]) if cc == c
                            for d in r.drafted])["acceptance_length"]
                           for c in sorted({c for c, _ in prompts})})
        report[name] = row
    if ASSISTED in runs:  # tokens per target forward (each verifies a batch of candidates)
        report[ASSISTED]["acceptance_length"] = (stats[ASSISTED]["tokens"]
                                                 / type(runs[ASSISTED].target).calls)
    engine_read = probe(3)
    engine = vllm_rows(served_base, prompts, eos, base["outputs"], hf_rate, own_rate, args)
    engine_read = (engine_read + probe(3)) / 2
    for row in engine.values():
        row["of_bound_during_run"] = row["tokens_per_s"] * read_bytes / (engine_read * 1e9)
    report.update(engine)
    for row in report.values():
        row["of_bandwidth_bound"] = row["tokens_per_s"] / bound
    sampled_reads = sorted(gbs for s in stats.values() for pair in s["read_gb_s"] for gbs in pair)
    median_read = sampled_reads[len(sampled_reads) // 2]
    batched = batch_throughput(model, hf_model, prompts, eos, args)
    sampled = sampling_speed(model, hf_model, prompts, eos, args, others)
    result = {
        "model": what + "".join(f" + {method_name(o)} draft of {p}"
                                for o, p in zip(others, args.also_model)),
        "machine": about,
        "bandwidth_bound_tokens_per_s": bound,
        # The read rate sampled before and after each method's run on each prompt (ReadProbe,
        # best of 3).
        "read_gb_s_during_run": {"min": sampled_reads[0],
                                 "median": median_read,
                                 "max": sampled_reads[-1], "samples": len(sampled_reads),
                                 "around_vllm": engine_read if engine else None},
        "layout": "TP=1 PP=1, batch 1, float32, greedy",
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "prompts": f"{args.data}: every {args.every}th first turn, {len(prompts)} prompts",
        "max_new_tokens": args.max_new_tokens,
        "methods": report,
        "batched_greedy": batched,
        "sampling": sampled,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=2))
    plot(report, out.with_suffix(".png"),
         f"{result['model']}; {about['cpu']}, {about['threads']} threads, commit {about['commit']}; "
         f"{len(prompts)} prompts")
    print(f"\n{result['model']}; {len(prompts)} MT-bench prompts, up to {args.max_new_tokens} new tokens, "
          f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{about['cpu']} ({' '.join(about['flags'])}), {about['threads']} threads, commit "
          f"{about['commit']}; read bandwidth {about['read_bandwidth_gb_s']:.1f} GB/s: batch-1 "
          f"bound {bound:.1f} tokens/s; sampled during the run {sampled_reads[0]:.1f}-"
          f"{sampled_reads[-1]:.1f} GB/s (median {median_read:.1f})")
    print(f"{'method':36}{'tok/s':>8}{'vs HF':>7}{'vs own':>8}{'bound':>7}{'run':>6}{'AL':>6}"
          f"{'drafted':>8}"
          f"{'same':>6}  time: draft/base/rest")
    for name, row in report.items():
        line = (f"{name:36}{row['tokens_per_s']:>8.2f}{row['vs_transformers_greedy']:>7.2f}"
                f"{row['vs_project_greedy']:>8.2f}{row['of_bandwidth_bound']:>7.2f}"
                f"{row['of_bound_during_run']:>6.2f}")
        if "time_share" in row:
            share = row["time_share"]
            line += (f"{row['acceptance_length']:>6.2f}{row['mean_drafted']:>8.2f}"
                     f"{row['identical_to_project_greedy']:>4}/{len(prompts)}"
                     f"  {share['draft']:.2f}/{share['base_forwards']:.2f}/{share['rest']:.2f}")
        else:
            al = row.get("acceptance_length")
            line += (f"{'' if al is None else f'{al:.2f}':>6}{'':>8}"
                     f"{row['identical_to_project_greedy']:>4}/{len(prompts)}")
        print(line)
    for against in ("project greedy", "transformers greedy"):
        print(f"vs {against} by category:")
        key = f"vs_{against.replace(' ', '_')}_by_category"
        for name, row in report.items():
            # The speculative rows, and project greedy itself against transformers.
            if "time_share" in row or (name == "project greedy" != against):
                print(f"  {name:34}" + " ".join(f"{c[:5]} {v:.2f}" for c, v in
                                              row[key].items()))
    for b, row in batched.items():
        print(f"batch {b}: project {row['project_tokens_per_s']:.2f} tok/s, transformers "
              f"{row['transformers_tokens_per_s']:.2f} ({row['ratio']:.2f}x), identical rows "
              f"{row['identical_rows']}")
    for name, row in sampled.get("methods", {}).items():
        print(f"T={args.temperature} {name:28}{row['tokens_per_s']:>8.2f} tok/s"
              + ("" if "acceptance_length" not in row else
                 f"   AL {row['acceptance_length']:.2f}"))
    print(f"wrote {out}")


def speed_by_category(prompts, stats, base):
    """{category: tokens/s of `stats` over tokens/s of `base` on that category's prompts}:
    against project greedy, the adaptive policy must not lose to plain decoding in any
    category; against transformers greedy, no category may fall below the target speedup."""
    def rate(s, category):
        picked = [i for i, (c, _) in enumerate(prompts) if c == category]
        return (sum(len(s["outputs"][i]) for i in picked)
                / sum(s["times"][i] for i in picked))
    return {c: rate(stats, c) / rate(base, c) for c in sorted({c for c, _ in prompts})}


def vllm_base(args, model_dir):
    """The HF directory of the base for vLLM (config, weights, tokenizer): --vllm-base, else
    the directory a --model checkpoint's base was converted from, else `model_dir`."""
    if args.vllm_base or not args.model:
        return Path(args.vllm_base or model_dir)
    from megatron_specdec.evaluation.transformers_baseline import hf_base_dir

    try:
        return hf_base_dir(args.model, flag="--vllm-base")
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None


def vllm_rows(model_dir, prompts, eos, greedy_outputs, hf_rate, own_rate, args):
    """vLLM greedy, n-gram and (--vllm-eagle3, --vllm-dflash) draft rows, or none (with the
    reason printed) without its env."""
    from megatron_specdec.engines import vllm_client

    runs = pick(vllm_configs(args), args.methods)
    if not runs:
        return {}
    try:
        results = vllm_client.generate(model_dir, [ids for _, ids in prompts],
                                       args.max_new_tokens, runs, stop_token_ids=eos)
    except (vllm_client.EngineUnavailableError, vllm_client.EngineRunError) as e:
        print(f"vLLM rows skipped: {e}")
        return {}
    rows = {}
    for name, r in results.items():
        if r.error:
            print(f"{name}: {r.error}")
            continue
        same = sum(out == ours for out, ours in zip(r.outputs, greedy_outputs))
        rows[name] = {"tokens_per_s": r.tokens_per_s, "vs_transformers_greedy":
                      r.tokens_per_s / hf_rate, "vs_project_greedy": r.tokens_per_s / own_rate,
                      "identical_to_project_greedy": same,
                      "acceptance_length": r.acceptance_length}
    return rows


def vllm_configs(args) -> dict:
    """{row name: vLLM speculative config (None: plain greedy)} for the flags given, {} with
    --no-vllm."""
    from megatron_specdec import registry
    from megatron_specdec.engines import vllm_client

    if args.no_vllm:
        return {}
    runs = {"vllm greedy": None, "vllm ngram k=3": vllm_client.ngram_config(3)}
    k = args.num_draft_tokens or 3
    for name, path in vllm_drafts(args).items():
        method = "eagle3" if name == "peagle" else name  # its config.json says parallel_drafting
        runs[f"vllm {name} k={k}"] = registry.get(method).engine_config(path, k).vllm
    if args.draft_model_hf:
        runs[f"vllm draft model k={k}"] = vllm_client.draft_model_config(args.draft_model_hf, k)
    return runs


def check_methods(names, known):
    """Refuse a --methods name that is no row of this run, naming the rows there are."""
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise SystemExit(f"--methods {' '.join(map(repr, unknown))}: no such row; expected "
                         f"some of {', '.join(map(repr, sorted(known)))}")


def pick(runs: dict, names) -> dict:
    """`runs` cut to the --methods `names` and the two anchors (all of them without)."""
    if names is None:
        return runs
    keep = set(names) | {"transformers greedy", "project greedy"}
    return {name: run for name, run in runs.items() if name in keep}


def vllm_drafts(args) -> dict:
    """{method: HF draft directory} of the --vllm-<method> flags given."""
    return {name: path for name, path in (("eagle3", args.vllm_eagle3),
                                          ("dflash", args.vllm_dflash),
                                          ("peagle", args.vllm_peagle)) if path}


def batch_throughput(model, hf_model, prompts, eos, args):
    """Plain greedy over left-padded batches of the prompts: project vs transformers."""
    from megatron_specdec.inference.generation import plain_generate

    out = {}
    for size in args.batch_sizes:
        tokens = {"project": 0, "transformers": 0}
        seconds = {"project": 0.0, "transformers": 0.0}
        same = total = 0
        for i in range(0, len(prompts), size):
            batch = [ids for _, ids in prompts[i: i + size]]
            start = time.perf_counter()
            ours = plain_generate(model.base, batch, args.max_new_tokens, model.vocab_size, eos)
            seconds["project"] += time.perf_counter() - start
            start = time.perf_counter()
            theirs = hf_batch(hf_model, batch, eos, args.max_new_tokens)
            seconds["transformers"] += time.perf_counter() - start
            tokens["project"] += sum(map(len, ours))
            tokens["transformers"] += sum(map(len, theirs))
            same += sum(a == b for a, b in zip(ours, theirs))
            total += len(batch)
        rates = {k: tokens[k] / seconds[k] for k in tokens}
        out[size] = {"project_tokens_per_s": rates["project"],
                     "transformers_tokens_per_s": rates["transformers"],
                     "ratio": rates["project"] / rates["transformers"],
                     "identical_rows": f"{same}/{total}"}
    return out


def hf_batch(hf_model, batch, eos, max_new_tokens):
    """transformers greedy on a left-padded batch; each row cut at its first stop token."""
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=list(eos), pad_token_id=0)
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def sampling_speed(model, hf_model, prompts, eos, args, others=()):
    """tokens/s of sampling at --temperature: transformers, project plain, project
    speculative (the draft module, n-gram); seeded per prompt, outputs differ by design."""
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.metrics import acceptance_summary
    from megatron_specdec.inference.sampling import Sampling, TypicalAcceptance
    from megatron_specdec.inference.generation import plain_generate

    if not args.temperature:
        return {}
    n, t = args.max_new_tokens, args.temperature
    prompts = prompts[:: args.sampling_every]
    generators = {f"project {method_name(model)} speculative": SpeculativeGenerator(model),
                  "project ngram speculative": SpeculativeGenerator(model, drafter_kind="ngram"),
                  **{f"project {method_name(o)} speculative": SpeculativeGenerator(o)
                     for o in others}}
    generators.update({f"project {name} speculative": g for name, g in
                       draft_model_generators(args, model, {"adaptive": "adaptive"}).items()})
    if model.method.typical_acceptance:  # the lossy option beside the lossless ones
        generators["project medusa typical acceptance"] = SpeculativeGenerator(
            model, typical=TypicalAcceptance())
    stats = {name: [0.0, 0, []] for name in
             ["transformers sampling", "project plain sampling", *generators]}
    for i, (_, ids) in enumerate(prompts):
        start = time.perf_counter()
        torch.manual_seed(i)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=True,
                                    temperature=t, top_k=0, top_p=1.0, eos_token_id=list(eos),
                                    pad_token_id=0)
        stats["transformers sampling"][0] += time.perf_counter() - start
        stats["transformers sampling"][1] += out.shape[1] - len(ids)
        start = time.perf_counter()
        plain = plain_generate(model.base, [ids], n, model.vocab_size, eos, temperature=t,
                               generator=torch.Generator().manual_seed(i))[0]
        stats["project plain sampling"][0] += time.perf_counter() - start
        stats["project plain sampling"][1] += len(plain)
        for name, generator in generators.items():
            start = time.perf_counter()
            result = generator.generate(ids, n, eos, sampling=Sampling(t, seed=i))
            stats[name][0] += time.perf_counter() - start
            stats[name][1] += len(result.tokens)
            stats[name][2].append(result)
    methods = {}
    for name, (seconds, tokens, results) in stats.items():
        methods[name] = {"tokens_per_s": tokens / seconds}
        if results:
            methods[name]["acceptance_length"] = acceptance_summary(
                [a for r in results for a in r.accepted], results[0].num_draft_tokens,
                [d for r in results for d in r.drafted])["acceptance_length"]
    return {"temperature": t, "top_k": 0, "top_p": 1.0, "prompts": len(prompts),
            "methods": methods}


def plot(report, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names, [report[n]["vs_transformers_greedy"] for n in names], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("tokens/s relative to transformers greedy (same process, same prompts)")
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()

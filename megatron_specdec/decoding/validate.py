"""Acceptance-length validation of a speculative model over a jsonl of chat prompts.

    python -m megatron_specdec.decoding.validate --model CKPT \\
        --data data/sources/mt_bench.jsonl --out runs/validate \\
        [--num-prompts 8] [--max-new-tokens 128] [--num-draft-tokens 7] [--tp 2] [--pp 1]
        [--tree-top-k 4 [--tree-max-nodes 32]]
        [--drafter eagle3|medusa|ngram|draft-model [--draft-model DRAFT_CKPT]]
        [--draft-policy adaptive|fixed] [--temperature 0.7 [--top-k 50] [--top-p 0.9] [--seed 0]]
        [--acceptance typical [--typical-eps 0.09] [--typical-alpha 0.3]] [--batch-size 4]

Each line is a question: the first of its `turns` (MT-bench; or its `prompt`) goes through
the tokenizer's chat template as one user message; later turns are not used (a multi-turn
evaluation would need the model's own earlier answers in the context). `category` groups the
report. Speculative generation runs --batch-size prompts at a time (default 1; rows accept
ragged counts); plain generation of the same base on the same batches gives the tokens/s
baseline of the same runtime and checks that both produce the same tokens. Prints a short
table (acceptance length, per-position acceptance, tokens/s, identity) and writes the full
report to OUT/acceptance.json and its plot to OUT/acceptance.png (acceptance rate per draft
position, overall and per category). With --tree-top-k the drafts form a
tree of depth --num-draft-tokens (decoding/tree.py); acceptance length is counted the same way
(tokens per verify forward), and "draft position" is the depth along the accepted path. With
--tp/--pp > 1 and no torchrun environment, the ranks are spawned locally.
"""

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from megatron_specdec.cli import ArgumentParser, run_cli
from megatron_specdec.decoding.metrics import summarise_by_category


def read_prompts(path, tokenizer, num_prompts=None):
    """[(category, token ids)] for the first turn of each question in a jsonl file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            text = record["turns"][0] if record.get("turns") else record.get("prompt")
            if not isinstance(text, str) or not text:
                raise ValueError(f"{path}:{n}: no `turns` or `prompt` text")
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            out.append((record.get("category", "all"), list(ids)))
            if num_prompts is not None and len(out) >= num_prompts:
                break
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def _resolve(model_or_ckpt, tokenizer):
    """(speculative model, tokenizer) from a model object or a speculative checkpoint path."""
    from megatron.core import parallel_state as ps

    from megatron_specdec import distributed
    from megatron_specdec.data import load_tokenizer

    if isinstance(model_or_ckpt, (str, os.PathLike)):
        from megatron_specdec.loading import load_model

        if not ps.model_parallel_is_initialized():
            distributed.initialize(1, 1)
        loaded = load_model(model_or_ckpt, need_draft=True)
        model, tokenizer = loaded.model, tokenizer or loaded.tokenizer_dir
    elif tokenizer is None:
        raise ValueError("evaluate_acceptance needs a tokenizer when given a model object")
    else:
        model = model_or_ckpt
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer))
    return model.eval(), tokenizer


def evaluate_acceptance(model_or_ckpt, prompts_path, tokenizer=None, *, max_new_tokens=128,
                        num_draft_tokens=None, num_prompts=None, out_dir=None,
                        compare_greedy=True, progress=True, tree=None, drafter=None,
                        policy="adaptive", sampling=None, draft_model=None, batch_size=1,
                        typical=None):
    """Acceptance length, per-position acceptance (overall and per category) and tokens/s;
    `tree`: a TreeSpec to draft trees instead of chains; `drafter`: eagle3, medusa, ngram or
    draft-model (default: the model's own draft module; `draft_model`: the draft GPT
    checkpoint of draft-model); `policy`: adaptive or fixed draft length;
    `sampling`: a decoding.sampling.Sampling (the batch from prompt i on uses seed + i; the
    baseline is then plain sampling, and outputs are not compared); `batch_size`: prompts
    per batch; `typical`: a sampling.TypicalAcceptance (Medusa, lossy) instead of rejection
    sampling.

    model_or_ckpt: a SpeculativeGPTModel stage (process groups initialised by the caller;
    then `tokenizer`, a tokenizer or its directory, is required) or a speculative checkpoint
    directory (loaded at the current TP/PP, or TP=PP=1 when none is set up). Collective over
    the model-parallel group; every rank returns the report, rank 0 writes `out_dir`.
    """
    from tqdm import tqdm

    from megatron_specdec.data import end_of_turn_ids
    from megatron_specdec.decoding.generator import SpeculativeGenerator
    from megatron_specdec.distributed import is_rank0
    from megatron_specdec.generation import plain_generate

    check_batch_size(batch_size)
    model, tokenizer = _resolve(model_or_ckpt, tokenizer)
    prompts = read_prompts(prompts_path, tokenizer, num_prompts)
    eos = end_of_turn_ids(tokenizer)
    generator = SpeculativeGenerator(model, num_draft_tokens, tree=tree, policy=policy,
                                     drafter_kind=drafter, draft_model=draft_model,
                                     typical=typical)
    sampled = sampling is not None and not sampling.greedy
    seed = (sampling.seed or 0) if sampled else 0
    records, spec_time, greedy_time, identical, plain_tokens = [], 0.0, 0.0, 0, 0
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    for i, batch in enumerate(tqdm(batches, desc="acceptance",
                                   disable=not (progress and is_rank0()))):
        ids = [p for _, p in batch]
        settings = replace(sampling, seed=seed + i * batch_size) if sampled else None
        start = time.perf_counter()
        results = generator.generate_batch(ids, max_new_tokens, eos, sampling=settings)
        spec_time += time.perf_counter() - start
        if compare_greedy:
            knobs = {} if not sampled else dict(
                temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                generator=torch.Generator().manual_seed(settings.seed))
            start = time.perf_counter()
            plain = plain_generate(model.base, ids, max_new_tokens, model.vocab_size, eos,
                                   **knobs)
            greedy_time += time.perf_counter() - start
            plain_tokens += sum(len(p) for p in plain)
            identical += sum(p == r.tokens for p, r in zip(plain, results))
        records += [{"category": category, "accepted": result.accepted,
                     "drafted": result.drafted, "new_tokens": len(result.tokens)}
                    for (category, _), result in zip(batch, results)]
    tokens = sum(r["new_tokens"] for r in records)
    report = {
        "algo": drafter or model.algo,
        **({} if draft_model is None else {"draft_model": str(draft_model)}),
        "draft_policy": policy if tree is None else "tree",
        "num_draft_tokens": generator.k,
        "tree": None if tree is None else {"top_k": tree.top_k, "max_nodes": tree.max_nodes,
                                           "nodes": tree.num_nodes(generator.k)},
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "num_prompts": len(records),
        "prompts": f"{prompts_path} (first turn of each question, chat template)",
        **summarise_by_category(records, generator.k),
        "new_tokens": tokens,
        "speculative_tokens_per_s": tokens / spec_time,
    }
    if sampled:
        report["sampling"] = asdict(sampling)
        report["acceptance"] = "rejection" if typical is None else {"typical": asdict(typical)}
    if compare_greedy:
        report["greedy_tokens_per_s"] = plain_tokens / greedy_time  # plain sampling if sampled
        report["speedup"] = report["speculative_tokens_per_s"] / report["greedy_tokens_per_s"]
        if not sampled:
            report["identical_to_greedy"] = f"{identical}/{len(records)}"
    report["per_prompt"] = records
    if out_dir is not None and is_rank0():
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "acceptance.json").write_text(json.dumps(report, indent=2))
        plot_acceptance(report, out_dir / "acceptance.png")
    return report


def format_report(report) -> str:
    """The report as a short table a person reads (the JSON is for programs): acceptance
    length (AL), mean tokens drafted a round, P(draft j accepted | j-1 accepted) as pj,
    overall and per category; tokens/s, and whether outputs matched greedy."""
    k, tree = report["num_draft_tokens"], report.get("tree")
    shape = (f"{report['draft_policy']} chain, k={k}" if tree is None
             else f"tree depth {k}, top-{tree['top_k']}, {tree['nodes']} nodes")
    counts = {}
    for record in report.get("per_prompt", []):
        counts[record["category"]] = counts.get(record["category"], 0) + 1
    rows = [("overall", report["num_prompts"], report["overall"])]
    if len(report["categories"]) > 1:
        rows += [(name, counts.get(name, ""), s) for name, s in report["categories"].items()]
    width = max(len(name) for name, _, _ in rows) + 2
    lines = [f"{report['algo']} ({shape}): {report['num_prompts']} prompts x "
             f"{report['max_new_tokens']} new tokens, batch {report['batch_size']}",
             f"{'':{width}}{'prompts':>8}{'AL':>7}{'drafted':>8}   "
             + " ".join(f"{'p' + str(j):>5}" for j in range(1, k + 1))]
    for name, n, s in rows:
        al, drafted = s["acceptance_length"], s["mean_drafted"]
        lines.append(f"{name:{width}}{n:>8}{_fixed(al, 7, 2)}{_fixed(drafted, 8, 2)}   "
                     + " ".join(_fixed(p, 5, 2) for p in s["position_acceptance"]))
    speed = f"tokens/s: speculative {report['speculative_tokens_per_s']:.1f}"
    if "greedy_tokens_per_s" in report:
        plain = "plain sampling" if "sampling" in report else "plain greedy"
        speed += (f", {plain} {report['greedy_tokens_per_s']:.1f} "
                  f"(speedup {report['speedup']:.2f}x)")
    if "identical_to_greedy" in report:
        speed += f"; identical to greedy: {report['identical_to_greedy']}"
    legend = ("AL: tokens per verify forward; drafted: tokens drafted a round; "
              "pj: P(draft j accepted | draft j-1 accepted)")
    return "\n".join(lines + [speed, legend])


def _fixed(value, width, digits) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def plot_acceptance(report, path):
    """Acceptance rate per draft position: overall (bold) and one line per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = report["num_draft_tokens"]
    positions = list(range(1, k + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, summary in report["categories"].items():
        ax.plot(positions, _nan(summary["position_acceptance"]), marker=".", alpha=0.6,
                label=f"{name} ({summary['acceptance_length']:.2f})")
    overall = report["overall"]
    ax.plot(positions, _nan(overall["position_acceptance"]), color="black", linewidth=2.5,
            marker="o", label=f"overall ({overall['acceptance_length']:.2f})")
    ax.set_xlabel("draft position j" if report.get("tree") is None else "tree depth j")
    ax.set_ylabel("P(j accepted | j-1 accepted)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(positions)
    tree = report.get("tree")
    shape = (f"k={k}" if tree is None
             else f"tree depth {k}, top-{tree['top_k']}, {tree['nodes']} nodes")
    ax.set_title(f"{report['algo']}: acceptance length {overall['acceptance_length']:.2f} "
                 f"({shape}, {report['num_prompts']} prompts)")
    ax.legend(fontsize=8, title="category (acceptance length)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _nan(values):
    return [float("nan") if v is None else v for v in values]


def build_parser():
    p = ArgumentParser(description=__doc__, renamed={"--out-dir": "--out"})
    p.add_argument("--model", required=True, help="speculative checkpoint directory")
    p.add_argument("--data", required=True, help="jsonl of prompts, e.g. MT-bench")
    p.add_argument("--out", required=True,
                   help="directory to write: acceptance.json (the full report), acceptance.png")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts only")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per prompt (fewer at an end of turn)")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="chain length k, or tree depth (default: EAGLE3 ttt_steps, Medusa heads)")
    p.add_argument("--tree-top-k", type=int, default=None,
                   help="draft a tree with this branching (EAGLE-2 style) instead of a chain")
    p.add_argument("--tree-max-nodes", type=int, default=None,
                   help="keep this many tree nodes of highest draft probability (default: all)")
    add_drafting_args(p)
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts generated together (rows accept ragged counts)")
    p.add_argument("--no-greedy", action="store_true", help="skip the plain greedy baseline")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    return p


def add_drafting_args(p):
    """--drafter and --draft-policy, shared with bench/bench_generation.py."""
    from megatron_specdec.decoding.draft_policy import POLICIES
    from megatron_specdec.decoding.generator import DRAFTERS
    from megatron_specdec.decoding.sampling import ACCEPTANCE, TypicalAcceptance

    p.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="who drafts (default: the checkpoint's draft module; ngram needs none)")
    p.add_argument("--draft-model", default=None,
                   help="--drafter draft-model: a GPT checkpoint of the target's vocabulary")
    p.add_argument("--draft-policy", choices=POLICIES, default="adaptive",
                   help="adaptive: draft while the draft is confident (default); fixed: always k")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples losslessly (chains and trees)")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k likeliest (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass")
    p.add_argument("--seed", type=int, default=0, help="sampling: seed of the first prompt")
    p.add_argument("--acceptance", choices=ACCEPTANCE, default="rejection",
                   help="sampling: rejection (lossless, default) or typical (Medusa's typical "
                        "acceptance: lossy, Medusa chains only)")
    p.add_argument("--typical-eps", type=float, default=TypicalAcceptance.eps,
                   help="--acceptance typical: probability floor eps")
    p.add_argument("--typical-alpha", type=float, default=TypicalAcceptance.alpha,
                   help="--acceptance typical: entropy factor alpha")


def sampling_of(args):
    """The Sampling of --temperature/--top-k/--top-p/--seed (None: greedy)."""
    from megatron_specdec.decoding.sampling import Sampling

    settings = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    return None if settings.greedy else settings


def typical_of(args):
    """The TypicalAcceptance of --acceptance typical and --typical-eps/--typical-alpha (None:
    rejection sampling); errors name the flag."""
    from megatron_specdec.decoding.sampling import TypicalAcceptance

    if args.acceptance != "typical":
        if (args.typical_eps, args.typical_alpha) != (TypicalAcceptance.eps,
                                                      TypicalAcceptance.alpha):
            raise ValueError("--typical-eps/--typical-alpha need --acceptance typical")
        return None
    if args.temperature <= 0 or args.top_k or args.top_p < 1:
        raise ValueError("--acceptance typical needs --temperature > 0 and no --top-k/--top-p")
    return TypicalAcceptance(args.typical_eps, args.typical_alpha)


def check_draft_model_args(args, vocab_size: int, tokenizer_dir):
    """--draft-model goes with --drafter draft-model, and its vocabulary is the target's
    (`vocab_size`, `tokenizer_dir`): checked before any rank starts."""
    if (args.drafter == "draft-model") != (args.draft_model is not None):
        raise ValueError("--drafter draft-model needs --draft-model PATH, and --draft-model "
                         "needs --drafter draft-model")
    if args.draft_model is not None:
        from megatron_specdec.decoding.draft_model_drafter import check_draft_checkpoint

        check_draft_checkpoint(args.draft_model, vocab_size, tokenizer_dir)


def check_batch_size(batch_size):
    """--batch-size is an integer >= 1 (the CLI checks it before any rank starts)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be an integer >= 1, got {batch_size}")


def tree_spec(args):
    """The TreeSpec of --tree-top-k / --tree-max-nodes (None: chain drafting)."""
    from megatron_specdec.decoding.tree import TreeSpec

    if args.tree_top_k is None:
        if args.tree_max_nodes is not None:
            raise ValueError("--tree-max-nodes needs --tree-top-k")
        return None
    return TreeSpec(args.tree_top_k, args.tree_max_nodes)


def _worker(args):
    from megatron_specdec import distributed
    from megatron_specdec.distributed import is_rank0

    distributed.initialize(args.tp, args.pp)
    report = evaluate_acceptance(args.model, args.data, max_new_tokens=args.max_new_tokens,
                                 num_draft_tokens=args.num_draft_tokens,
                                 num_prompts=args.num_prompts, out_dir=args.out,
                                 compare_greedy=not args.no_greedy, tree=tree_spec(args),
                                 drafter=args.drafter, policy=args.draft_policy,
                                 sampling=sampling_of(args), draft_model=args.draft_model,
                                 batch_size=args.batch_size, typical=typical_of(args))
    if is_rank0():
        print(format_report(report))
        print(f"full report: {Path(args.out) / 'acceptance.json'} (plot: acceptance.png)")


def main(argv=None):
    from megatron_specdec import checkpoint

    args = build_parser().parse_args(argv)
    if not Path(args.data).is_file():
        raise FileNotFoundError(f"prompt file {args.data} not found")
    meta = checkpoint.read_meta(args.model)  # a clear error here, before any rank starts
    check_draft_model_args(args, meta["hf_config"]["vocab_size"],
                           Path(args.model) / checkpoint.TOKENIZER_DIR)
    tree_spec(args)
    sampling_of(args)
    typical_of(args)
    check_batch_size(args.batch_size)
    if args.tp * args.pp > 1 and "RANK" not in os.environ:
        from megatron_specdec import distributed

        distributed.spawn(_worker, args.tp * args.pp, args)
    else:
        _worker(args)


def cli() -> int:
    """Console entry point (setup.py)."""
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(cli())

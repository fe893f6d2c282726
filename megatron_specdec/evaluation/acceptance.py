"""Acceptance-length measurement of a speculative model over a jsonl of chat prompts (the
library behind `python -m megatron_specdec.cli.validate` and training's periodic evaluation):
the first turn of each question through the chat template, speculative generation in batches,
plain generation of the same base as the tokens/s baseline and the identity check."""

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from megatron_specdec.checkpointing.checkpoint import write_text_atomic
from megatron_specdec.data.jsonl import BadRows, iter_jsonl
from megatron_specdec.evaluation.plots import plot_acceptance
from megatron_specdec.evaluation.transformers_baseline import hf_generate, load_transformers
from megatron_specdec.inference.metrics import summarise_by_category

# The untimed first call: this many prompt tokens, and as many new ones.
WARM_UP_TOKENS = 8


def check_batch_size(batch_size):
    """--batch-size is an integer >= 1 (the CLI checks it before any rank starts)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be an integer >= 1, got {batch_size}")


def check_transformers_baseline(batch_size, sampling, world: int):
    """The transformers baseline is batch-1 greedy decoding in one process: what a user runs
    with `generate` by default (the CLI checks it before any rank starts)."""
    if batch_size != 1 or (sampling is not None and not sampling.greedy) or world != 1:
        raise ValueError("--transformers times batch-1 greedy decoding in one process: it needs "
                         "--batch-size 1, no --temperature, and --tp 1 --pp 1")


def _first_turn(record: dict):
    """The first user turn of a prompt record: MT-bench's `turns`, a `prompt`, or the first
    user message of a conversation (the training data's rows)."""
    if record.get("turns"):
        return record["turns"][0]
    if "prompt" in record:
        return record["prompt"]
    return next((m.get("content") for m in record.get("conversations") or ()
                 if isinstance(m, dict) and m.get("role") == "user"), None)


def read_prompts(path, tokenizer, num_prompts=None):
    """[(category, token ids)] of each record's first user turn in a jsonl file (`.gz` read
    decompressed). Conversation rows count too, so that a file of one's own data kept out of
    training is a validation split; a record's category is its `category`, else its `source`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    out = []
    for n, record in iter_jsonl(path, BadRows("fail")):
        text = _first_turn(record)
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{n}: no `turns`, `prompt` or user message in `conversations`")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        out.append((record.get("category") or record.get("source") or "all", list(ids)))
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
        from megatron_specdec.loading.source import load_model

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
                        typical=None, prompt_bucket=None, transformers=None):
    """Acceptance length, per-position acceptance (overall and per category) and tokens/s;
    `tree`: a TreeSpec to draft trees instead of chains; `drafter`: eagle3, medusa, ngram,
    draft_model, ... (registry names; default: the model's own draft module; `draft_model`: the
    draft GPT checkpoint of the draft_model method); `policy`: adaptive or fixed draft length;
    `sampling`: an inference.sampling.Sampling (the batch from prompt i on uses seed + i; the
    baseline is then plain sampling, and outputs are not compared); `batch_size`: prompts
    per batch; `typical`: a sampling.TypicalAcceptance (Medusa, lossy) instead of rejection
    sampling; `prompt_bucket`: a batch's prompts are padded to a multiple of this many tokens
    (generation.left_pad; None: its default); `transformers`: the HF directory of the base, to
    time stock transformers `generate` on the same prompts as well (batch 1, greedy, one
    process: check_transformers_baseline).

    model_or_ckpt: a SpeculativeGPTModel stage (process groups initialised by the caller;
    then `tokenizer`, a tokenizer or its directory, is required) or a speculative checkpoint
    directory (loaded at the current TP/PP, or TP=PP=1 when none is set up). Collective over
    the model-parallel group; every rank returns the report, rank 0 writes `out_dir`.
    """
    from tqdm import tqdm

    from megatron_specdec.data import end_of_turn_ids
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.distributed import is_rank0
    from megatron_specdec.inference.generation import plain_generate

    check_batch_size(batch_size)
    if transformers is not None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        check_transformers_baseline(batch_size, sampling, world)
    model, tokenizer = _resolve(model_or_ckpt, tokenizer)
    prompts = read_prompts(prompts_path, tokenizer, num_prompts)
    eos = end_of_turn_ids(tokenizer)
    generator = SpeculativeGenerator(model, num_draft_tokens, tree=tree, policy=policy,
                                     drafter_kind=drafter, draft_model=draft_model,
                                     typical=typical, prompt_bucket=prompt_bucket)
    sampled = sampling is not None and not sampling.greedy
    seed = (sampling.seed or 0) if sampled else 0
    records, spec_time, greedy_time, identical, plain_tokens = [], 0.0, 0.0, 0, 0
    hf_model, hf_time, hf_tokens, hf_identical = None, 0.0, 0, 0
    if transformers is not None:
        hf_model = load_transformers(transformers, next(model.base.parameters()).dtype)
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    if prompts and max_new_tokens > 0:
        # Untimed: a process's first calls pay once (the kernel choice measures weight shapes
        # it has not met, e.g. a new draft's; first allocations), which would otherwise be
        # charged to whichever path runs first.
        warm = [prompts[0][1][:WARM_UP_TOKENS]]
        generator.generate_batch(warm, WARM_UP_TOKENS, eos)
        if compare_greedy:
            plain_generate(model.base, warm, WARM_UP_TOKENS, model.vocab_size, eos,
                           prompt_bucket=prompt_bucket)
        if hf_model is not None:
            hf_generate(hf_model, warm[0], WARM_UP_TOKENS, eos)
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
                                   prompt_bucket=prompt_bucket, **knobs)
            greedy_time += time.perf_counter() - start
            plain_tokens += sum(len(p) for p in plain)
            identical += sum(p == r.tokens for p, r in zip(plain, results))
        if hf_model is not None:
            start = time.perf_counter()
            theirs = hf_generate(hf_model, ids[0], max_new_tokens, eos)
            hf_time += time.perf_counter() - start
            hf_tokens += len(theirs)
            hf_identical += theirs == results[0].tokens
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
    if hf_model is not None:
        report["transformers"] = str(transformers)
        report["transformers_tokens_per_s"] = hf_tokens / hf_time
        report["speedup_vs_transformers"] = (report["speculative_tokens_per_s"]
                                             / report["transformers_tokens_per_s"])
        report["identical_to_transformers"] = f"{hf_identical}/{len(records)}"
    report["per_prompt"] = records
    if out_dir is not None and is_rank0():
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out_dir / "acceptance.json", json.dumps(report, indent=2))
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
    if "transformers_tokens_per_s" in report:
        theirs = report["transformers_tokens_per_s"]
        speed += (f"\ntransformers generate (greedy) {theirs:.1f} tokens/s: speculative "
                  f"{report['speedup_vs_transformers']:.2f}x that")
        if "greedy_tokens_per_s" in report:
            speed += f", plain greedy {report['greedy_tokens_per_s'] / theirs:.2f}x"
        speed += f"; identical to it: {report['identical_to_transformers']}"
    legend = ("AL: tokens per verify forward; drafted: tokens drafted a round; "
              "pj: P(draft j accepted | draft j-1 accepted)")
    return "\n".join(lines + [speed, legend])


def _fixed(value, width, digits) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

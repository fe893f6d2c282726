"""Acceptance parity: the same draft (EAGLE3 or DFlash) served by vLLM and run by the
project's decoder.

The project side is what `python -m megatron_specdec.cli.validate --draft-policy fixed
--num-draft-tokens K` runs (SpeculativeGenerator with the checkpoint's draft method's
proposer, K drafted every round, pooled acceptance length), on a speculative checkpoint
holding the draft; the vLLM side serves the HF export of the same draft (`--draft`) with that
method's speculative_config (registry engine_config: "eagle3", or "dflash", whose one block
forward drafts num_speculative_tokens every round) on the same fp32 base (the embedded
SmolLM2 HF directory) through engines/vllm_client.py, in its own process, one engine per run.
Both get the same token ids (first turn of each question through the chat template), generate
up to --max-new-tokens greedily at batch 1 and stop at the tokenizer's end-of-turn ids.

Acceptance length is counted alike: tokens per verify forward, the bonus token included,
pooled over the forwards of all prompts. vLLM: 1 + accepted / drafts from its spec-decode
counters, where `drafts` counts the verify steps that carried drafts; the project: (accepted +
forwards) / forwards. On both sides the prefill drafts nothing and is not counted, and the
last round counts all the drafts it accepted, also those past the stop. Identity: each
side's speculative output against plain greedy (the project's own, and vLLM's). The two sides
run at the same time (vLLM in its own process), so their tokens/s are not a speed comparison.

    python bench/bench_engine_parity.py [--model runs/shipped_spec] [--draft models/eagle3_smollm2]
        [--data bench/mt_bench_3per_category.jsonl] [--num-prompts 24] [--every 1]
        [--max-new-tokens 64] [--ks 1 3 7] [--out JSON]

--model must hold the draft of --draft imported onto the fp32 base (EAGLE3:
models/eagle3_smollm2/README.md, `checkpoint_tools/import_draft.py`; DFlash: the registry's
import_hf, methods/dflash/hf_export.import_dflash); the method is --model's draft algo.
Table on stdout, JSON in bench/results/engine_parity.json (EAGLE3) or
engine_parity_<method>.json.
"""

import argparse
import json
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TOLERANCE = 0.05  # the target: vLLM's acceptance length within 5% of the project's


def unconditional_per_position(accepted, k):
    """Rounds that accepted at least j drafts, j = 1..k (vLLM's per-position counter)."""
    return [sum(a >= j for a in accepted) for j in range(1, k + 1)]


def results_file(method):
    """engine_parity.json for EAGLE3 (the first method measured), else engine_parity_<method>."""
    return RESULTS / ("engine_parity.json" if method == "eagle3"
                      else f"engine_parity_{method}.json")


def project_side(model_dir, prompts, ks, max_new_tokens, eos):
    """Plain greedy outputs, and per k: the project's outputs, accepted drafts per round (also
    per prompt), seconds."""
    from megatron_specdec import distributed
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.loading.speculative import load_speculative

    distributed.initialize(1, 1)
    model, _, _ = load_speculative(model_dir)
    model.eval()
    out = {"greedy": [plain_generate(model.base, [ids], max_new_tokens, model.vocab_size,
                                     eos)[0] for ids in prompts]}
    for k in ks:
        generator = SpeculativeGenerator(model, k, policy="fixed")
        outputs, accepted, drafted, start = [], [], [], time.perf_counter()
        per_prompt = []
        for ids in prompts:
            result = generator.generate(ids, max_new_tokens, eos)
            outputs.append(result.tokens)
            accepted += result.accepted
            drafted += result.drafted
            per_prompt.append(result.accepted)
        if any(d != k for d in drafted):
            raise RuntimeError(f"the fixed policy drafted fewer than {k} tokens in a round")
        print(f"project k={k}: {len(accepted)} rounds, {sum(accepted)} accepted", flush=True)
        out[k] = {"outputs": outputs, "seconds": time.perf_counter() - start,
                  "rounds": len(accepted), "accepted": sum(accepted),
                  "acceptance_length": (sum(accepted) + len(accepted)) / len(accepted),
                  "accepted_per_position": unconditional_per_position(accepted, k),
                  "accepted_per_prompt": per_prompt}
    return out


def vllm_side(method, base_dir, draft_dir, prompts, ks, max_new_tokens, eos, timeout):
    from megatron_specdec import registry
    from megatron_specdec.engines import vllm_client

    engine_config = registry.get(method).engine_config
    runs = {"greedy": None, **{f"{method} k={k}": engine_config(draft_dir, k).vllm for k in ks}}
    results = vllm_client.generate(base_dir, prompts, max_new_tokens, runs,
                                   stop_token_ids=eos, timeout=timeout)
    for name, r in results.items():
        if r.error:
            raise RuntimeError(f"vLLM run {name!r} failed: {r.error} ({r.where})")
    return results


def compare(method, project, engine, ks, n):
    rows, greedy = [], engine["greedy"].outputs
    for k in ks:
        p, v = project[k], engine[f"{method} k={k}"]
        rows.append({
            "k": k,
            "project_acceptance_length": p["acceptance_length"],
            "vllm_acceptance_length": v.acceptance_length,
            "relative_gap": v.acceptance_length / p["acceptance_length"] - 1,
            "project_rounds": p["rounds"], "vllm_rounds": v.drafts,
            "project_accepted": p["accepted"], "vllm_accepted": v.accepted,
            "project_accepted_per_position": p["accepted_per_position"],
            "vllm_accepted_per_position": v.accepted_per_position,
            "outputs_identical": sum(a == b == c for a, b, c in
                                     zip(p["outputs"], v.outputs, greedy)),
            "project_identical_to_project_greedy": sum(
                a == b for a, b in zip(p["outputs"], project["greedy"])),
            "vllm_identical_to_vllm_greedy": sum(a == b for a, b in zip(v.outputs, greedy)),
            "project_accepted_per_prompt": p["accepted_per_prompt"],
            "project_tokens_per_s": sum(map(len, p["outputs"])) / p["seconds"],
            "vllm_tokens_per_s": v.tokens_per_s,
        })
    return {"num_prompts": n, "rows": rows,
            "greedy_identical": sum(a == b for a, b in zip(project["greedy"], greedy))}


def print_table(report):
    n = report["num_prompts"]
    print(f"\n{report['method']}: {n} prompts, up to {report['max_new_tokens']} new tokens; "
          f"project greedy == vLLM greedy {report['greedy_identical']}/{n}; identical: each "
          f"side's speculative == its greedy, and project spec == vLLM spec == vLLM greedy")
    print("| k | project AL | vLLM AL | gap | rounds (project / vLLM) | accepted (project / vLLM) "
          "| project == greedy | vLLM == greedy | all identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['k']} | {r['project_acceptance_length']:.3f} | "
              f"{r['vllm_acceptance_length']:.3f} | {100 * r['relative_gap']:+.1f}% | "
              f"{r['project_rounds']} / {r['vllm_rounds']} | "
              f"{r['project_accepted']} / {r['vllm_accepted']} | "
              f"{r['project_identical_to_project_greedy']}/{n} | "
              f"{r['vllm_identical_to_vllm_greedy']}/{n} | {r['outputs_identical']}/{n} |")


def main(argv=None):
    from megatron_specdec.cli.common import setup_logging

    setup_logging()  # quiet logs: benign library warnings off
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.data import end_of_turn_ids, load_tokenizer
    from megatron_specdec.evaluation.acceptance import read_prompts
    from megatron_specdec.models.default_model import default_model_dir

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/shipped_spec",
                   help="speculative checkpoint holding the draft (import_draft of --draft)")
    p.add_argument("--draft", default="models/eagle3_smollm2",
                   help="HF export of --model's draft for vLLM (EAGLE3 or DFlash layout)")
    p.add_argument("--data", default="bench/mt_bench_3per_category.jsonl")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--every", type=int, default=1,
                   help="every Nth question (3: one per category of the default --data)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7])
    p.add_argument("--vllm-timeout", type=float, default=7200,
                   help="seconds vLLM's process may take for all runs (a loaded 2-core host "
                        "needed more than 30 minutes for 24 prompts x 64 tokens x 3 engines)")
    p.add_argument("--out", default=None,
                   help="JSON report (default: bench/results/engine_parity[_<method>].json)")
    args = p.parse_args(argv)
    for flag, path in (("--model", args.model), ("--draft", args.draft), ("--data", args.data)):
        if not Path(path).exists():
            raise SystemExit(f"{flag} {path} does not exist")
    meta = checkpoint.read_meta(args.model)
    if meta.get("dtype") != "float32":
        raise SystemExit(f"--model {args.model} is {meta.get('dtype')}; parity needs the fp32 "
                         f"base vLLM serves")
    if "draft" not in meta:
        raise SystemExit(f"--model {args.model} holds no draft (not a speculative checkpoint)")
    method = meta["draft"]["algo"]
    draft_config = json.loads((Path(args.draft) / "config.json").read_text())
    tokenizer = load_tokenizer(str(Path(args.model) / checkpoint.TOKENIZER_DIR))
    questions = read_prompts(args.data, tokenizer)[::args.every][:args.num_prompts]
    prompts = [ids for _, ids in questions]
    eos = sorted(end_of_turn_ids(tokenizer))
    base_dir = default_model_dir()

    torch.set_grad_enabled(False)
    with ThreadPoolExecutor(1) as pool:  # vLLM's process runs while the project side does
        engine = pool.submit(vllm_side, method, base_dir, args.draft, prompts, args.ks,
                             args.max_new_tokens, eos, args.vllm_timeout)
        project = project_side(args.model, prompts, args.ks, args.max_new_tokens, eos)
        engine = engine.result()
    report = {
        "command": "python bench/bench_engine_parity.py " + " ".join(argv or []),
        "method": method, "model": args.model, "draft": args.draft,
        "vllm_base": str(base_dir),
        "data": f"{args.data} (first turn, chat template, every {args.every})",
        "categories": [c for c, _ in questions], "max_new_tokens": args.max_new_tokens,
        "stop_token_ids": eos,
        "dtype": f"float32 base and compute on both sides; draft weights as exported "
                 f"({draft_config.get('torch_dtype', 'float32')}), run in float32",
        "host": platform.node(), "tolerance": TOLERANCE,
        **compare(method, project, engine, args.ks, len(prompts)),
        "vllm_greedy_tokens_per_s": engine["greedy"].tokens_per_s,
    }
    report["within_tolerance"] = all(abs(r["relative_gap"]) <= TOLERANCE
                                     for r in report["rows"])
    print_table(report)
    out = Path(args.out or results_file(method))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])

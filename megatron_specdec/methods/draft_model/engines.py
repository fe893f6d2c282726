"""How the engines serve a separate draft model of the target's vocabulary (an ordinary HF
directory: checkpoint_tools/prune_depth.py, then megatron_to_hf.py)."""

from pathlib import Path

from megatron_specdec.engines import vllm_client
from megatron_specdec.registry import EngineConfig


def engine_config(draft_dir, num_draft_tokens: int) -> EngineConfig:
    path = str(Path(draft_dir).resolve())
    return EngineConfig(
        vllm=vllm_client.draft_model_config(draft_dir, num_draft_tokens),
        sglang=("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", path,
                "--speculative-num-steps", str(num_draft_tokens), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(num_draft_tokens + 1)),
        trtllm={"decoding_type": "Draft_Target", "max_draft_len": num_draft_tokens,
                "speculative_model_dir": path})

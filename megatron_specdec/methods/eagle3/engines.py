"""How the engines serve an exported EAGLE3 draft (the export's directory, k draft tokens)."""

from pathlib import Path

from megatron_specdec.engines import vllm_client
from megatron_specdec.registry import EngineConfig


def engine_config(draft_dir, num_draft_tokens: int) -> EngineConfig:
    path = str(Path(draft_dir).resolve())
    return EngineConfig(
        vllm=vllm_client.eagle3_config(draft_dir, num_draft_tokens),
        sglang=("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", path,
                "--speculative-num-steps", str(num_draft_tokens), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(num_draft_tokens + 1)),
        trtllm={"decoding_type": "Eagle", "max_draft_len": num_draft_tokens,
                "speculative_model_dir": path, "eagle3_one_model": True})

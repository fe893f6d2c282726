"""How the engines serve an exported EAGLE3 draft (the export's directory, k draft tokens).

A parallel-drafting export runs in vLLM only (`parallel_drafting`, read from its config.json
by vllm_client.eagle3_config): SGLang and TensorRT-LLM draft EAGLE3 as a chain, which would
feed its positions 2..k inputs it was not trained on."""

from pathlib import Path

from megatron_specdec.engines import vllm_client
from megatron_specdec.registry import EngineConfig


def engine_config(draft_dir, num_draft_tokens: int) -> EngineConfig:
    path = str(Path(draft_dir).resolve())
    vllm = vllm_client.eagle3_config(draft_dir, num_draft_tokens)
    if vllm.get("parallel_drafting"):
        return EngineConfig(vllm=vllm)
    return EngineConfig(
        vllm=vllm,
        sglang=("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", path,
                "--speculative-num-steps", str(num_draft_tokens), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(num_draft_tokens + 1)),
        trtllm={"decoding_type": "Eagle", "max_draft_len": num_draft_tokens,
                "speculative_model_dir": path, "eagle3_one_model": True})

"""How the engines serve an exported Medusa draft (FasterDecoding layout). vLLM asks for
num_speculative_tokens == medusa_num_heads; SGLang has no Medusa."""

from pathlib import Path

from megatron_specdec.engines import vllm_client
from megatron_specdec.registry import EngineConfig


def engine_config(draft_dir, num_draft_tokens: int) -> EngineConfig:
    path = str(Path(draft_dir).resolve())
    return EngineConfig(
        vllm=vllm_client.medusa_config(draft_dir, num_draft_tokens),
        trtllm={"decoding_type": "Medusa", "num_medusa_heads": num_draft_tokens,
                "speculative_model_dir": path})

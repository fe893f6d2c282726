"""How the engines serve a DFlash export. vLLM 0.32 (CPU build, run here): `method: "dflash"`,
k = num_speculative_tokens (config.json's block_size is not read). SGLang and TensorRT-LLM
serve DFlash too, but their flags were not read from their source nor executed here, so
none are given rather than guessed."""

from pathlib import Path

from megatron_specdec.registry import EngineConfig


def engine_config(draft_dir, num_draft_tokens: int) -> EngineConfig:
    model = str(Path(draft_dir).resolve()) if draft_dir is not None else None
    return EngineConfig(vllm={"method": "dflash", "model": model,
                              "num_speculative_tokens": num_draft_tokens})

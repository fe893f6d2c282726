"""Generation backend that runs the target as a Megatron-Core model in this process.

A thin adapter: loading and greedy decoding live in `megatron_specdec.checkpoint` and
`megatron_specdec.generation`, imported on construction so that the data package (and the
OpenAI path) never pull in Megatron. Single process only (tp=pp=1).
"""

from typing import Optional


class MegatronBackend:
    def __init__(self, checkpoint: str = "default", eos_ids: Optional[set] = None):
        try:
            from megatron_specdec.checkpoint import load_model_for_inference
            from megatron_specdec.generation import greedy_generate
        except ImportError as e:
            raise ImportError(f"the megatron backend needs megatron_specdec.checkpoint and .generation: {e}") from e
        if not eos_ids:
            raise ValueError("MegatronBackend needs the end-of-turn ids to stop on")
        self._generate = greedy_generate
        self._eos_ids = set(eos_ids)
        self._model = load_model_for_inference(checkpoint, tp=1, pp=1)

    def generate(self, prompts: list, max_new_tokens: int, messages: Optional[list] = None) -> list:
        return self._generate(self._model, prompts, max_new_tokens, self._eos_ids)

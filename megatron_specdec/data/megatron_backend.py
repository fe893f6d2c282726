"""Generation backend that runs the target as a Megatron-Core model in this process.

A thin adapter over `megatron_specdec.checkpoint.load_model_for_inference` and
`megatron_specdec.generation.greedy_generate`, imported on construction so that the data
package (and the OpenAI path) never pull in Megatron. Single process (tp=pp=1).
"""

from typing import Optional

from megatron_specdec.data.conversations import end_of_turn_ids, load_tokenizer


class MegatronBackend:
    """`tokenizer` defaults to the one stored with the checkpoint."""

    def __init__(self, checkpoint: str = "default", tokenizer=None):
        from megatron_specdec import distributed
        from megatron_specdec.checkpoint import load_model_for_inference
        from megatron_specdec.generation import greedy_generate

        distributed.initialize(tp=1, pp=1)
        self.model, config, tokenizer_dir = load_model_for_inference(checkpoint)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
        self._greedy_generate = greedy_generate
        self._vocab_size = config.vocab_size
        self._eos_ids = end_of_turn_ids(self.tokenizer)

    def generate(self, prompts: list, max_new_tokens: int, messages: Optional[list] = None) -> list:
        completions = self._greedy_generate(
            self.model, prompts, max_new_tokens, self._vocab_size, self._eos_ids
        )
        # greedy_generate drops the end-of-turn id; a row shorter than the budget stopped on one.
        eos = min(self._eos_ids)
        return [ids + [eos] if len(ids) < max_new_tokens else ids for ids in completions]

"""Generation backend that runs the target as a Megatron-Core model in this process.

A thin adapter over `megatron_specdec.loading.source.load_model` and
`megatron_specdec.inference.generation.plain_generate`, imported on construction so that the data
package (and the OpenAI path) never pull in Megatron. Single process (tp=pp=1).
"""

from functools import partial
from typing import Optional

import torch

from megatron_specdec.data.conversations import end_of_turn_ids, load_tokenizer


class MegatronBackend:
    """`tokenizer` defaults to the one stored with the checkpoint; `dtype` ("float32",
    "bfloat16" or None: the checkpoint's own) is the parameters'; `prompt_bucket`: see
    generation.left_pad."""

    def __init__(self, checkpoint: str = "default", tokenizer=None, dtype: Optional[str] = None,
                 prompt_bucket: Optional[int] = None):
        from megatron_specdec.checkpointing import checkpoint as ckpt
        from megatron_specdec import distributed
        from megatron_specdec.inference.generation import plain_generate
        from megatron_specdec.loading.source import load_model

        distributed.initialize(tp=1, pp=1)
        loaded = load_model(checkpoint, dtype=ckpt.dtype_from_name(dtype) if dtype else None,
                            with_draft=False)
        self.model, config, tokenizer_dir = loaded.model, loaded.hf_config, loaded.tokenizer_dir
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
        self._generate = partial(plain_generate, prompt_bucket=prompt_bucket)
        self._vocab_size = config.vocab_size
        self._eos_ids = end_of_turn_ids(self.tokenizer)

    def generate(self, prompts: list, max_new_tokens: int, messages: Optional[list] = None) -> list:
        return self._with_eos(
            self._generate(self.model, prompts, max_new_tokens, self._vocab_size, self._eos_ids),
            max_new_tokens,
        )

    def sample(self, prompts: list, max_new_tokens: int, temperature: float, top_p: float,
               seed: int) -> list:
        """Sampled continuations, reproducible for a given seed."""
        from megatron_specdec.distributed import device

        generator = torch.Generator(device=device()).manual_seed(seed)
        completions = self._generate(self.model, prompts, max_new_tokens, self._vocab_size,
                                     self._eos_ids, temperature, top_p, generator)
        return self._with_eos(completions, max_new_tokens)

    def _with_eos(self, completions, max_new_tokens):
        # plain_generate drops the end-of-turn id; a row shorter than the budget stopped on one.
        eos = min(self._eos_ids)
        return [ids + [eos] if len(ids) < max_new_tokens else ids for ids in completions]

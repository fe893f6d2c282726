"""Sampling settings shared by plain and speculative generation.

Both draw from `acceptance.reference.target_probs` (temperature, then top-k, then top-p), so
speculative sampling, which is lossless, emits tokens with exactly plain sampling's
distribution. Every model-parallel rank must draw the same numbers: the generator is seeded
from `seed`, or from one seed drawn on the first rank of the model-parallel group.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: Optional[int] = None
    # Drafters with their own distribution (EAGLE3) sample drafts from it and verify against
    # it; with one_hot_drafts they propose their top token and verify it as one-hot (vLLM's
    # default). Both are lossless.
    one_hot_drafts: bool = False

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no cut), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator:
        """A generator every model-parallel rank seeds alike."""
        seed = self.seed
        if seed is None:
            seed = torch.randint(0, 2**62, (1,), dtype=torch.long)
            if dist.is_initialized():
                from megatron.core import parallel_state as ps

                group = ps.get_model_parallel_group()
                dist.broadcast(seed, src=dist.get_process_group_ranks(group)[0], group=group)
            seed = int(seed)
        return torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Token ids [b] drawn from logits [b, V]."""
        from megatron_specdec.acceptance.reference import target_probs

        probs = target_probs(logits, self.temperature, self.top_k, self.top_p)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)


ACCEPTANCE = ("rejection", "typical")


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance, an explicitly lossy alternative to rejection sampling
    (acceptance.typical_verify): a draft is kept while the target, at the sampling
    temperature, gives it more than min(eps, alpha * exp(-entropy)), and the token after the
    kept drafts is the target's argmax. It accepts more than rejection sampling where the
    target is unsure, and its output does not follow the target's sampling distribution; as
    the temperature goes to 0 it becomes greedy verification."""

    eps: float = 0.09  # Medusa's posterior_threshold
    alpha: float = 0.3  # Medusa's posterior_alpha

    def __post_init__(self):
        if not (isinstance(self.eps, (int, float)) and 0 <= self.eps <= 1):
            raise ValueError(f"typical acceptance eps must lie in [0, 1] (a probability "
                             f"floor), got {self.eps}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha >= 0):
            raise ValueError(f"typical acceptance alpha must be finite and >= 0, "
                             f"got {self.alpha}")

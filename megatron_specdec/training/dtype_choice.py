"""`model.dtype: auto`: the training dtype this machine runs fastest, measured here.

bfloat16 is what GPUs and CPUs with bf16 dot-product instructions (AVX512-BF16, AMX) train
fastest in. A CPU without them runs a bf16 GEMM by converting to float32, several times slower
than float32 itself: the SmolLM2 EAGLE3 recipe in bfloat16 took ~45 s a step on a 2-core AMD
EPYC Zen 3 (AVX2 only). So `auto` is bfloat16 on a GPU and, on a CPU, whichever of bfloat16
and float32 runs a training-sized linear (forward and both backward products) faster, timed
on rank 0 and broadcast so that every rank trains in the same dtype.
"""

import logging
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

CHOICES = ("float32", "bfloat16")
# bfloat16 must win by this much: a near tie keeps float32's exact arithmetic.
BF16_MARGIN = 1.2


def linear_step_seconds(dtype, tokens: int = 512, hidden: int = 576, features: int = 1536,
                        repeats: int = 3) -> float:
    """Best time of one linear's forward and backward products in `dtype` on this CPU."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.randn(features, hidden, generator=g).to(dtype)
    grad = torch.randn(tokens, features, generator=g).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        start = time.perf_counter()
        x @ w.t()
        grad @ w
        grad.t() @ x
        best = min(best, time.perf_counter() - start)
    return best


def measure() -> str:
    """bfloat16 or float32 by the timing above (this process alone)."""
    fp32, bf16 = linear_step_seconds(torch.float32), linear_step_seconds(torch.bfloat16)
    choice = "bfloat16" if fp32 >= BF16_MARGIN * bf16 else "float32"
    log.info("model.dtype auto: %s (a training-sized linear took %.1f ms in float32 and %.1f ms "
             "in bfloat16 on this CPU)", choice, fp32 * 1e3, bf16 * 1e3)
    return choice


def choose() -> str:
    """The dtype `auto` stands for here; with a process group, rank 0's choice on every rank."""
    if torch.cuda.is_available():
        return "bfloat16"
    if not (dist.is_available() and dist.is_initialized()):
        return measure()
    code = torch.tensor([CHOICES.index(measure()) if dist.get_rank() == 0 else -1])
    dist.broadcast(code, src=0)
    return CHOICES[int(code)]


def resolve(recipe) -> None:
    """Replace `model.dtype: auto` in `recipe` by the dtype it stands for (no-op otherwise)."""
    if recipe.model.dtype == "auto":
        recipe.model.dtype = choose()

"""Python face of the acceptance ops: validate, draw the random numbers, dispatch.

The fused kernels (torch.ops.megatron_specdec.*) run when the extension
``megatron_specdec._C`` is importable and has a kernel for the tensors' device;
otherwise the PyTorch reference runs, after one RuntimeWarning per process.
Setting SPECDEC_DISABLE_EXT=1 before this module is imported forces the fallback.
All randomness is drawn here from the caller's generator, so both paths give the
same tokens for the same generator state.
"""
import os
import warnings
from functools import lru_cache

import torch

from megatron_specdec.acceptance import reference
from megatron_specdec.acceptance import validation as check

DISABLE_ENV = "SPECDEC_DISABLE_EXT"


def _load_extension():
    """None when the fused ops are registered, else why not."""
    if os.environ.get(DISABLE_ENV, "0") == "1":
        return f"disabled by {DISABLE_ENV}=1"
    try:
        import megatron_specdec._C  # noqa: F401  (registers torch.ops.megatron_specdec)
    except ImportError as exc:
        return f"megatron_specdec._C is not built ({exc})"
    return None


_EXT_ERROR = _load_extension()
_warned = False


def op_available(name: str, device=torch.device("cpu")) -> bool:
    """Whether torch.ops.megatron_specdec.<name> has a kernel for tensors on `device` (an
    extension built before the op existed has none)."""
    return _has_kernel(name, "CUDA" if torch.device(device).type == "cuda" else "CPU")


@lru_cache(maxsize=None)
def _has_kernel(name: str, key: str) -> bool:
    """op_available's answer, fixed for the process (decoding asks it every step)."""
    if _EXT_ERROR is not None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"megatron_specdec::{name}", key)
    except RuntimeError:  # the op is not registered at all: a build from before it
        return False


def extension_available(device=torch.device("cpu")):
    """Whether the fused ops run for tensors on `device`."""
    return op_available("greedy_chain_verify", device)


def _fused(device):
    """The fused op namespace for `device`, or None (after warning once) to use the reference."""
    global _warned
    if extension_available(device):
        return torch.ops.megatron_specdec
    if not _warned:
        _warned = True
        why = _EXT_ERROR or f"the extension has no kernels for {device}"
        warnings.warn(
            f"megatron_specdec acceptance ops fall back to the PyTorch reference: {why}",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def _lengths(lens, ids):
    """Per-request draft lengths; None means every request uses all of ids.shape[1]."""
    if lens is None and isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long, device=ids.device)
    return lens


def _uniforms(like, n, generator):
    return torch.rand(like.shape[0], n, generator=generator, device=like.device, dtype=torch.float32)


def greedy_chain_verify(draft_ids, target, draft_lens=None):
    """Greedy chain verification; `target` is logits [B, K+1, V] or argmax ids [B, K+1]."""
    draft_lens = _lengths(draft_lens, draft_ids)
    check.check_chain(draft_ids, draft_lens)
    if isinstance(target, torch.Tensor) and target.dtype == torch.int64:
        check.check_target_ids(target, draft_ids)
        fused = _fused(draft_ids.device)
        if fused is not None:
            return fused.greedy_chain_verify_ids(draft_ids, target, draft_lens)
        return reference.greedy_chain_verify_ids(draft_ids, target, draft_lens)
    vocab = check.check_logits("target_logits", target, draft_ids, draft_ids.shape[1] + 1)
    check.check_draft_ids(draft_ids, draft_lens, vocab)
    fused = _fused(draft_ids.device)
    if fused is not None:
        return fused.greedy_chain_verify(draft_ids, target, draft_lens)
    check.check_values(target)
    return reference.greedy_chain_verify(draft_ids, target, draft_lens)


def stochastic_chain_verify(
    draft_ids, target_logits, draft_lens=None, draft_probs=None, *, temperature=1.0, top_k=0, top_p=1.0,
    generator=None,
):
    """Lossless rejection-sampling chain verification (draws K+1 uniforms per request)."""
    draft_lens = _lengths(draft_lens, draft_ids)
    check.check_chain(draft_ids, draft_lens)
    k = draft_ids.shape[1]
    vocab = check.check_logits("target_logits", target_logits, draft_ids, k + 1)
    check.check_draft_ids(draft_ids, draft_lens, vocab)
    check.check_draft_probs(draft_probs, draft_ids, k, vocab)
    check.check_sampling(temperature, top_k, top_p)
    uniforms = _uniforms(draft_ids, k + 1, generator)
    args = (draft_ids, target_logits, draft_lens, draft_probs, uniforms, float(temperature), int(top_k), float(top_p))
    fused = _fused(draft_ids.device)
    if fused is not None:
        return fused.stochastic_chain_verify(*args)
    check.check_values(target_logits, temperature, draft_probs)
    return reference.stochastic_chain_verify(*args)


def tree_verify(
    tree_ids, parents, target_logits, num_nodes=None, draft_probs=None, *, temperature=0.0, top_k=0, top_p=1.0,
    max_depth=None, generator=None,
):
    """Tree verification: greedy when temperature == 0, else multi-candidate rejection sampling.

    Returns (tokens [B, max_depth+1], counts [B], path [B, max_depth]); max_depth
    defaults to the depth of the deepest node in the batch.
    """
    num_nodes = _lengths(num_nodes, tree_ids)
    check.check_tree(tree_ids, parents, num_nodes)
    n = tree_ids.shape[1]
    vocab = check.check_logits("target_logits", target_logits, tree_ids, n + 1)
    check.check_tree_ids(tree_ids, num_nodes, vocab)
    depth = int(reference.tree_depths(parents, num_nodes).max()) if n else 0
    max_depth = depth if max_depth is None else int(max_depth)
    check.check_max_depth(max_depth, depth, n)
    if temperature == 0:
        if draft_probs is not None or top_k or top_p < 1:
            raise ValueError("greedy tree verification (temperature 0) takes no draft_probs, top_k or top_p")
        fused = _fused(tree_ids.device)
        if fused is not None:
            return fused.tree_verify_greedy(tree_ids, parents, target_logits, num_nodes, max_depth)
        check.check_values(target_logits)
        return reference.tree_verify_greedy(tree_ids, parents, target_logits, num_nodes, max_depth)
    check.check_draft_probs(draft_probs, tree_ids, n, vocab)
    check.check_sampling(temperature, top_k, top_p)
    uniforms = _uniforms(tree_ids, n + 1, generator)
    args = (tree_ids, parents, target_logits, num_nodes, draft_probs, uniforms, max_depth, float(temperature),
            int(top_k), float(top_p))
    fused = _fused(tree_ids.device)
    if fused is not None:
        return fused.tree_verify_stochastic(*args)
    check.check_values(target_logits, temperature, draft_probs)
    return reference.tree_verify_stochastic(*args)


def typical_verify(draft_ids, target_logits, draft_lens=None, *, temperature=1.0, eps=0.09, alpha=0.3):
    """Medusa typical acceptance: accept d_i while p_i(d_i) > min(eps, alpha * exp(-H(p_i)))."""
    draft_lens = _lengths(draft_lens, draft_ids)
    check.check_chain(draft_ids, draft_lens)
    vocab = check.check_logits("target_logits", target_logits, draft_ids, draft_ids.shape[1] + 1)
    check.check_draft_ids(draft_ids, draft_lens, vocab)
    check.check_sampling(temperature)
    check.check_typical(eps, alpha)
    args = (draft_ids, target_logits, draft_lens, float(temperature), float(eps), float(alpha))
    fused = _fused(draft_ids.device)
    if fused is not None:
        return fused.typical_verify(*args)
    check.check_values(target_logits, temperature)
    return reference.typical_verify(*args)

"""Input checks of the acceptance ops' Python face.

Every problem raises ValueError (TypeError for dtypes) naming the argument, what
was expected and what was found, before any kernel or reference indexes with it.
``check_values`` reads whole tensors; it runs only before the reference fallback,
because the fused ops check each value they read themselves.
"""
import math

import torch

# Keep in step with csrc/limits.h.
MAX_DRAFT_LEN = 64
MAX_TREE_NODES = 256

_FLOAT_TYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_dtype(name, t, allowed):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, found {type(t).__name__}")
    if t.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in {[str(a) for a in allowed]}, found {t.dtype}")


def _check_shape(name, t, shape):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, found {list(t.shape)}")


def _check_device(name, t, like):
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device} (like the draft ids), found {t.device}")


def _check_ids(name, ids, valid, vocab):
    bad = valid & ((ids < 0) | (ids >= vocab))
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(f"{name}{where} must be in [0, {vocab}), found {int(ids[tuple(where)])}")


def check_lengths(name, lens, batch, max_len, like):
    _check_dtype(name, lens, (torch.int64,))
    _check_shape(name, lens, (batch,))
    _check_device(name, lens, like)
    bad = (lens < 0) | (lens > max_len)
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise ValueError(f"{name}[{b}] must be in [0, {max_len}], found {int(lens[b])}")


def check_chain(draft_ids, draft_lens):
    """draft_ids [B, K] int64 with K <= MAX_DRAFT_LEN; draft_lens [B] int64 in [0, K]."""
    _check_dtype("draft_ids", draft_ids, (torch.int64,))
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must have shape [B, K], found {list(draft_ids.shape)}")
    batch, k = draft_ids.shape
    if k > MAX_DRAFT_LEN:
        raise ValueError(f"draft length K = draft_ids.shape[1] must be <= {MAX_DRAFT_LEN}, found {k}")
    check_lengths("draft_lens", draft_lens, batch, k, draft_ids)


def check_draft_ids(draft_ids, draft_lens, vocab):
    pos = torch.arange(draft_ids.shape[1], device=draft_ids.device)
    _check_ids("draft_ids", draft_ids, pos < draft_lens[:, None], vocab)


def check_logits(name, logits, like, rows):
    _check_dtype(name, logits, _FLOAT_TYPES)
    _check_device(name, logits, like)
    if logits.dim() != 3 or logits.shape[:2] != (like.shape[0], rows) or logits.shape[2] < 1:
        raise ValueError(f"{name} must have shape [{like.shape[0]}, {rows}, V >= 1], found {list(logits.shape)}")
    return logits.shape[2]


def check_target_ids(target_ids, like):
    _check_device("target_ids", target_ids, like)
    _check_shape("target_ids", target_ids, (like.shape[0], like.shape[1] + 1))


def check_draft_probs(draft_probs, like, n, vocab):
    if draft_probs is None:
        return
    _check_dtype("draft_probs", draft_probs, _FLOAT_TYPES)
    _check_device("draft_probs", draft_probs, like)
    _check_shape("draft_probs", draft_probs, (like.shape[0], n, vocab))


def check_sampling(temperature, top_k=0, top_p=1.0):
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be finite and > 0 (temperature 0 is the greedy op), found {temperature}"
        )
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), found {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], found {top_p}")


def check_typical(eps, alpha):
    for name, value in (("eps", eps), ("alpha", alpha)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, found {value}")


def check_tree(tree_ids, parents, num_nodes):
    """tree_ids, parents [B, N] int64, N <= MAX_TREE_NODES; valid nodes' parents precede them."""
    _check_dtype("tree_ids", tree_ids, (torch.int64,))
    if tree_ids.dim() != 2:
        raise ValueError(f"tree_ids must have shape [B, N], found {list(tree_ids.shape)}")
    batch, n = tree_ids.shape
    if n > MAX_TREE_NODES:
        raise ValueError(f"tree size N = tree_ids.shape[1] must be <= {MAX_TREE_NODES}, found {n}")
    _check_dtype("parents", parents, (torch.int64,))
    _check_device("parents", parents, tree_ids)
    _check_shape("parents", parents, (batch, n))
    check_lengths("num_nodes", num_nodes, batch, n, tree_ids)
    index = torch.arange(n, device=tree_ids.device)
    valid = index < num_nodes[:, None]
    bad = valid & ((parents < -1) | (parents >= index))
    if bool(bad.any()):
        b, i = bad.nonzero()[0].tolist()
        raise ValueError(
            f"parents[{b}, {i}] must be in [-1, {i}) (parents precede children), found {int(parents[b, i])}"
        )


def check_tree_ids(tree_ids, num_nodes, vocab):
    valid = torch.arange(tree_ids.shape[1], device=tree_ids.device) < num_nodes[:, None]
    _check_ids("tree_ids", tree_ids, valid, vocab)


def check_max_depth(max_depth, depth, n):
    if not 0 <= max_depth <= n:
        raise ValueError(f"max_depth must be in [0, {n}], found {max_depth}")
    if depth > max_depth:
        raise ValueError(f"the tree has depth {depth} > max_depth {max_depth}")


def check_values(target_logits, temperature=None, draft_probs=None):
    """Full-tensor value checks: no NaN logits (greedy, temperature None); when sampling,
    logits finite or -inf after temperature with no all -inf row, and proper draft probs."""
    if temperature is None:
        if bool(torch.isnan(target_logits).any()):
            raise ValueError("target_logits contains NaN")
        return
    x = target_logits.double() / temperature
    if bool((torch.isnan(x) | torch.isposinf(x)).any()):
        raise ValueError("target_logits must be finite or -inf (after temperature); found NaN or +inf")
    if x.numel() and bool(torch.isneginf(x).all(-1).any()):
        raise ValueError("a target_logits row is entirely -inf (no token can be sampled)")
    if draft_probs is not None and draft_probs.numel():
        q = draft_probs.double()
        if not bool(((q >= 0) & torch.isfinite(q)).all()):
            raise ValueError("draft_probs must be finite and >= 0; found NaN, inf or a negative value")

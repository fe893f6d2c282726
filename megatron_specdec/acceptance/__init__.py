"""Draft-token acceptance (verification) ops for speculative decoding.

Fused C++ (CPU) and CUDA kernels registered as ``torch.ops.megatron_specdec.*``,
with a pure-PyTorch reference (``reference``) that defines their semantics and
serves as the fallback when the extension is not built (one RuntimeWarning per
process; set SPECDEC_DISABLE_EXT=1 before import to force it). Inputs are
validated in Python and again inside the ops; errors name the argument.

Shapes: B requests, K draft tokens per chain (K <= 64), N tree nodes (N <= 256),
V vocabulary. Ids and lengths are int64; logits and draft probabilities may be
float32/float64/float16/bfloat16. Outputs are int64 on the input device: ``tokens``
padded with -1, where row b holds ``counts[b]`` accepted draft tokens followed by
one target token (the correction at the first rejection, or the bonus token).

    greedy_chain_verify(draft_ids [B,K], target, draft_lens=None)
        target: logits [B,K+1,V] or argmax ids [B,K+1] (int64).
        Accepts the longest prefix with draft[i] == argmax target[i].
        -> tokens [B,K+1], counts [B]

    stochastic_chain_verify(draft_ids [B,K], target_logits [B,K+1,V], draft_lens=None,
                            draft_probs=None [B,K,V], *, temperature=1.0, top_k=0,
                            top_p=1.0, generator=None)
        Lossless rejection sampling: accept d_i with prob min(1, p(d_i)/q(d_i)); on
        rejection sample norm(max(0, p - q)); after all accepted sample the bonus from p.
        draft_probs None means a greedy draft (q one-hot). temperature > 0; top-k/top-p
        shape p (the target), applied before verification.
        -> tokens [B,K+1], counts [B]

    tree_verify(tree_ids [B,N], parents [B,N], target_logits [B,N+1,V], num_nodes=None [B],
                draft_probs=None [B,N,V], *, temperature=0.0, top_k=0, top_p=1.0,
                max_depth=None, generator=None)
        parents[i] = -1 for children of the root, else an index < i. Row 0 of the
        logits follows the root, row i+1 follows node i. temperature 0: greedy (deepest
        path matching the argmax; lowest index among equals). temperature > 0: recursive
        rejection sampling over siblings in index order (SpecInfer/EAGLE); with
        draft_probs, draft_probs[:, i] is the distribution node i was drawn from,
        independently of its siblings.
        -> tokens [B,max_depth+1], counts [B], path [B,max_depth] (accepted node indices)

    typical_verify(draft_ids [B,K], target_logits [B,K+1,V], draft_lens=None, *,
                   temperature=1.0, eps=0.09, alpha=0.3)
        Medusa typical acceptance: accept d_i while p_i(d_i) > min(eps, alpha*exp(-H(p_i))),
        p_i = softmax(logits_i / temperature). The base model's own token (Medusa's
        candidate 0) is the root of the chain and is never re-verified; the emitted
        token after the prefix is the target argmax, as in the greedy op. For several
        Medusa candidates per request, put them in the batch and keep the longest.
        -> tokens [B,K+1], counts [B]

The raw ops (torch.ops.megatron_specdec.*: greedy_chain_verify, greedy_chain_verify_ids,
stochastic_chain_verify, tree_verify_greedy, tree_verify_stochastic, typical_verify; schemas
in csrc/ops.cpp) take the random numbers as an argument: ``uniforms`` float32 [B,K+1]
(chain: K accept tests, then one draw) or [B,N+1] (tree: one per node, then one draw),
so a given generator state yields the same tokens on every path. On CUDA the ops copy
the small index tensors to the host for checks and sync once to report value errors.
"""
from megatron_specdec.acceptance.ops import (
    extension_available,
    greedy_chain_verify,
    stochastic_chain_verify,
    tree_verify,
    typical_verify,
)

__all__ = [
    "extension_available",
    "greedy_chain_verify",
    "stochastic_chain_verify",
    "tree_verify",
    "typical_verify",
]

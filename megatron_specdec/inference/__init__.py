"""Speculative decoding with a SpeculativeGPTModel over megatron-core KV caches.

`SpeculativeGenerator(model, num_draft_tokens).generate(prompt_ids, max_new_tokens, eos_ids)`
(or `.generate_batch(prompts, ...)`: rows accept ragged counts) drafts a chain of up to k
tokens (EAGLE3 draft with its own KV cache, Medusa heads, or prompt lookup; draft_policy.py
decides how many), verifies it in one base forward, accepts with the fused chain ops and
rolls both caches back; greedy, its output equals plain greedy generation; with
`sampling=Sampling(...)` it samples losslessly. `tree=TreeSpec(top_k, max_nodes)` (batch 1)
drafts an EAGLE-2-style tree of depth k instead and verifies it in one forward with a tree
mask (the fused greedy tree op). Drafting is the draft method's proposer (methods/<name>/
proposer.py), reached through megatron_specdec.registry. Also here: plain generation
(generation), the base runner, draft policy, sampling, trees, and the data generator's
backend that runs a loaded model (data_backend). evaluation.acceptance measures acceptance
length over a prompt set.
"""

from megatron_specdec.inference.generator import GenerationResult, SpeculativeGenerator
from megatron_specdec.inference.metrics import acceptance_summary
from megatron_specdec.inference.tree import TreeSpec

__all__ = ["GenerationResult", "SpeculativeGenerator", "TreeSpec", "acceptance_summary"]

"""Speculative generation (greedy, or lossless sampling for chains) from a
SpeculativeGPTModel at any TP/PP (batch 1).

Every rank of the model-parallel group runs the same loop. Per round the last stage drafts
up to k tokens (the DraftPolicy decides how many: draft_policy.py; none makes the round a
plain decoding step), all stages run the base once over [pending, d_1..d_n], the last stage
accepts with the fused greedy chain op on the base's argmax ids and broadcasts the verdict;
every stage rewinds its base cache by the n - a rejected positions and the drafter re-reads
the base states of the a + 1 kept ones. Drafters: EAGLE3, Medusa, or prompt lookup (n-gram).
The emitted sequence is the base's own greedy continuation, so it matches
generation.greedy_generate token for token (up to float ties between a k+1-token and a
1-token forward). A separate GPT of the target's vocabulary can draft instead
(`drafter_kind="draft-model"`, draft_model_drafter.py).

With `tree=TreeSpec(top_k, max_nodes)` the last stage drafts a tree of depth k instead
(tree.py), all stages verify [pending, nodes] in one base forward under the tree mask, the
fused greedy tree op picks the deepest accepted path, and every stage moves that path's cache
entries to the slots after pending (StageRunner.compact) rather than recomputing them: a
copy of a + 1 entries per layer instead of another base forward. Output is again the base's
greedy continuation.

Batch 1: requests accept different counts, and megatron's static cache advances all rows by
one offset (RoPE position = slot), so ragged acceptance would need per-row positions.
"""

from dataclasses import dataclass, field
from typing import Dict, List

import time
from functools import partial

import torch

from megatron_specdec.acceptance import greedy_chain_verify, stochastic_chain_verify, tree_verify
from megatron_specdec.decoding.base_runner import BaseOutput, BaseRunner
from megatron_specdec.decoding.draft_policy import DraftPolicy
from megatron_specdec.decoding.sampling import Sampling
from megatron_specdec.decoding.tree import TreeSpec, verify_layout


@dataclass
class GenerationResult:
    tokens: List[int]
    accepted: List[int] = field(default_factory=list)  # accepted drafts per verify forward
    num_draft_tokens: int = 0  # chain length, or tree depth
    drafted: List[int] = field(default_factory=list)  # drafts per verify forward
    # Wall seconds in drafting (propose, and the drafter reading accepted states), in base
    # forwards (prefill and verify), and in all (the rest is acceptance and bookkeeping).
    seconds: Dict[str, float] = field(
        default_factory=lambda: {"draft": 0.0, "base": 0.0, "total": 0.0})


def default_num_draft_tokens(model) -> int:
    cfg = model.spec_config
    return cfg.ttt_steps if model.algo == "eagle3" else cfg.medusa_num_heads


DRAFTERS = ("eagle3", "medusa", "ngram", "draft-model")


def check_drafter_kind(model, kind: str = None) -> str:
    """`kind`, or the model's own draft module when None, if this model can draft with it."""
    kind = kind or model.algo
    if kind not in DRAFTERS:
        raise ValueError(f"drafter {kind!r}; expected one of {DRAFTERS}")
    if kind not in ("ngram", "draft-model") and kind != model.algo:
        raise ValueError(f"drafter {kind!r} needs a model whose draft module is {kind}; "
                         f"this one's is {model.algo}")
    return kind


def build_drafter(model, kind: str = None, draft_model=None):
    """This stage's drafter of `kind` (default: the model's own draft module; None before the
    last stage); `draft_model`: the draft checkpoint of kind draft-model. Collective over the
    pipeline (over the world for a draft model)."""
    from megatron.core import parallel_state as ps

    kind = check_drafter_kind(model, kind)
    if (kind == "draft-model") != (draft_model is not None):
        raise ValueError("--draft-model goes with --drafter draft-model, and it needs one")
    if kind == "draft-model":
        from megatron_specdec.decoding.draft_model_drafter import (
            DraftModelDrafter,
            load_draft_model,
        )

        draft = load_draft_model(draft_model, model.vocab_size)
        return DraftModelDrafter(draft, model.vocab_size) if ps.is_pipeline_last_stage() else None
    if kind == "ngram":
        from megatron_specdec.decoding.ngram_drafter import NgramDrafter

        return NgramDrafter() if ps.is_pipeline_last_stage() else None
    if kind == "medusa":
        if not ps.is_pipeline_last_stage():
            return None
        from megatron_specdec.decoding.medusa_drafter import MedusaDrafter

        return MedusaDrafter(model)
    from megatron_specdec.decoding.eagle3_drafter import Eagle3Drafter
    from megatron_specdec.decoding.embedding import last_stage_embedding

    embedding = last_stage_embedding(model)
    return Eagle3Drafter(model, embedding) if ps.is_pipeline_last_stage() else None


def draft_vocab_size(model) -> int:
    return model.vocab_size if model.algo == "medusa" else model.spec_config.draft_vocab_size


class SpeculativeGenerator:
    """Build once per model (the EAGLE3 embedding replica is loaded here), then `generate`.
    `tree`: draft a tree of depth num_draft_tokens with this branching instead of a chain.
    `policy`: "adaptive" (draft while confident, default) or "fixed" (always k), or a
    DraftPolicy. `drafter_kind`: eagle3, medusa, ngram or draft-model (default: the model's
    module); `draft_model`: the draft-model checkpoint."""

    def __init__(self, model, num_draft_tokens: int = None, drafter=None,
                 tree: TreeSpec = None, policy="adaptive", drafter_kind: str = None,
                 draft_model=None):
        self.model = model
        self.k = (default_num_draft_tokens(model) if num_draft_tokens is None
                  else num_draft_tokens)
        if check_drafter_kind(model, drafter_kind) == "medusa" and \
                self.k > model.spec_config.medusa_num_heads:
            raise ValueError(f"num_draft_tokens {self.k} exceeds the "
                             f"{model.spec_config.medusa_num_heads} Medusa heads")
        self.policy = policy if isinstance(policy, DraftPolicy) else \
            DraftPolicy.named(policy, self.k)
        if tree is not None:
            if drafter_kind in ("ngram", "draft-model"):
                raise ValueError(f"the {drafter_kind} drafter drafts chains, not trees")
            tree.check(self.k, draft_vocab_size(model))
        self.tree = tree
        self.drafter = drafter if drafter is not None else \
            build_drafter(model, drafter_kind, draft_model)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, eos_ids=(),
                 sampling: Sampling = None) -> GenerationResult:
        """Continuation of one prompt (token ids), stopping at any id in `eos_ids` (not
        included) or after `max_new_tokens`: greedy, or sampled losslessly with `sampling`
        (chains: drafts sampled from the draft's distribution, or proposed one-hot, are
        accepted by rejection sampling, so the output has plain sampling's distribution).
        Every rank returns the result."""
        from megatron_specdec.distributed import device

        if len(prompt_ids) == 0:
            raise ValueError("the prompt needs at least one token")
        sampling = sampling if sampling is not None and not sampling.greedy else None
        if sampling is not None and self.tree is not None:
            raise NotImplementedError("sampled tree drafting is not built; use a chain")
        self._sampling = sampling
        self._rng = None if sampling is None else sampling.generator(device())
        started = time.perf_counter()
        k, drafter = self.k, self.drafter
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device())
        eos = set(int(e) for e in eos_ids)
        result = self._result = GenerationResult([], [], k)
        clock = self._clock

        def emit(token: int) -> bool:
            """Append token; True when generation is over."""
            if token in eos:
                return True
            result.tokens.append(token)
            return len(result.tokens) >= max_new_tokens

        def done() -> GenerationResult:
            result.seconds["total"] = time.perf_counter() - started
            return result

        if max_new_tokens <= 0:
            return done()
        width = k if self.tree is None else self.tree.num_nodes(k)
        max_length = prompt.shape[1] + max_new_tokens + width + 1
        runner = BaseRunner(self.model, 1, max_length)
        out = clock("base", partial(runner.step, last_only=True), prompt)
        pending = torch.zeros(1, 1, dtype=torch.long, device=prompt.device)
        if runner.last:
            last = out.logits[:, -1]
            pending[:, 0] = last.argmax(-1) if sampling is None else \
                sampling.sample(last, self._rng)
            clock("draft", drafter.start, prompt, pending, out, max_length)
        runner.broadcast_from_last(pending)
        if emit(int(pending)):
            return done()
        verify = self._verify_chain if self.tree is None else self._verify_tree
        self._unread, self._skip, self._backoff = [], 0, 0
        while True:
            accepted, drafted, new, out = verify(runner, pending)
            result.accepted.append(accepted)
            result.drafted.append(drafted)
            if any(emit(int(t)) for t in new[0]):
                return done()
            if runner.last:
                self._unread.append((new, out))
            pending = new[:, -1:]

    def _draft(self, k: int):
        """The last stage's drafts [1, n] for this round: none while sitting out a backoff
        (draft_policy.py); otherwise the drafter first reads the base states it has not seen.
        Sampled drafts leave their distributions in `_draft_probs` for `_accept`."""
        self._draft_probs = None
        if self._skip:
            self._skip -= 1
            return torch.zeros(1, 0, dtype=torch.long, device=self._unread[0][0].device)
        self._catch_up()
        s = self._sampling
        if s is not None and not s.one_hot_drafts and hasattr(self.drafter, "propose_sampled"):
            drafts, self._draft_probs = self._clock(
                "draft", self.drafter.propose_sampled, k, self.policy, s, self._rng)
        else:
            drafts = self._clock("draft", self.drafter.propose, k, self.policy)
        if not getattr(self.drafter, "free_to_probe", False):
            self._backoff = self._skip = self.policy.next_backoff(self._backoff,
                                                                  drafts.shape[1])
        return drafts

    def _catch_up(self):
        """The drafter reads the base states of the rounds it has not seen, in one call."""
        if self._unread:
            tokens = torch.cat([t for t, _ in self._unread], dim=1)
            states = BaseOutput.cat([o for _, o in self._unread])
            self._clock("draft", self.drafter.accept, tokens.shape[1] - 1, tokens, states)
            self._unread = []

    def _clock(self, part: str, fn, *args):
        """fn(*args), its wall time added to the current result's `seconds[part]`."""
        start = time.perf_counter()
        value = fn(*args)
        self._result.seconds[part] += time.perf_counter() - start
        return value

    def _verify_chain(self, runner, pending):
        """One round: draft up to k, verify, rewind the rejected. Returns (accepted count,
        drafted count, emitted tokens [1, a + 1], base states of the a + 1 kept positions
        (last stage))."""
        k = self.k
        proposal = torch.zeros(1, k + 1, dtype=torch.long, device=pending.device)
        if runner.last:  # the drafts, then their count: one broadcast
            drafts = self._draft(k)
            proposal[:, : drafts.shape[1]] = drafts
            proposal[0, k] = drafts.shape[1]
        runner.broadcast_from_last(proposal)
        n = int(proposal[0, k])
        drafts = proposal[:, :n]
        out = self._clock("base", runner.step, torch.cat([pending, drafts], dim=1))
        verdict = torch.zeros(1, k + 2, dtype=torch.long, device=pending.device)
        if runner.last:
            tokens, counts = self._accept(drafts, out.logits)
            verdict[:, : n + 1] = tokens
            verdict[0, -1] = counts[0]
        runner.broadcast_from_last(verdict)
        accepted = int(verdict[0, -1])
        runner.rewind(n - accepted)
        kept = out.rows(slice(0, accepted + 1)) if runner.last else None
        return accepted, n, verdict[:, : accepted + 1], kept

    def _accept(self, drafts, logits):
        """(emitted tokens [1, n + 1] padded with -1, accepted count [1]) of a chain."""
        if self._sampling is None:
            return greedy_chain_verify(drafts, logits.argmax(-1))
        s = self._sampling
        return stochastic_chain_verify(drafts, logits, draft_probs=self._draft_probs,
                                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                       generator=self._rng)

    def _verify_tree(self, runner, pending):
        """The same round over a draft tree of up to n nodes (none: a plain step); the
        accepted path's cache entries are compacted."""
        k, n = self.k, self.tree.num_nodes(self.k)
        tree = torch.zeros(2, n + 1, dtype=torch.long, device=pending.device)
        if runner.last:  # tokens and parents, then the node count: one broadcast
            self._catch_up()
            drafted = self._clock("draft", self.drafter.propose_tree, k, self.tree,
                                  self.policy.tree_floor)
            m = drafted.tokens.numel()
            tree[:, :m] = torch.stack([drafted.tokens, drafted.parents])
            tree[0, n] = m
        runner.broadcast_from_last(tree)
        m = int(tree[0, n])
        tokens, parents = tree[0:1, :m], tree[1:2, :m]
        start = runner.length  # pending's slot
        positions, mask = verify_layout(parents[0], start)
        out = self._clock("base", runner.step, torch.cat([pending, tokens], dim=1), positions,
                          mask)
        verdict = torch.zeros(1, 2 * k + 3, dtype=torch.long, device=pending.device)
        if runner.last:
            emitted, counts, path = tree_verify(tokens, parents, out.logits)
            depth = path.shape[1]
            verdict[:, : depth + 1] = emitted
            verdict[:, k + 1: k + 1 + depth] = path
            verdict[0, -2], verdict[0, -1] = depth, counts[0]
        runner.broadcast_from_last(verdict)
        depth, accepted = int(verdict[0, -2]), int(verdict[0, -1])
        path = verdict[0, k + 1: k + 1 + accepted]
        runner.compact(start + 1, start + 1 + path)
        kept = torch.cat([path.new_zeros(1), path + 1])
        return accepted, depth, verdict[:, : accepted + 1], out.rows(kept) if runner.last else None

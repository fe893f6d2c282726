"""Speculative generation (greedy, or lossless sampling) from a SpeculativeGPTModel at any
TP/PP, for a batch of prompts.

Every rank of the model-parallel group runs the same loop. Per round the last stage drafts
up to k tokens per row (the DraftPolicy decides how many, row by row: draft_policy.py; none
makes the round a plain decoding step for that row), all stages run the base once over
[pending, d_1..d_n] (n: the most any row drafted), the last stage accepts with the fused
chain op on the base's argmax ids, each row up to its own draft count, and broadcasts the
verdict; every stage rewinds each row of its base cache by its own rejected positions, and
the drafter re-reads the base states of each row's kept ones. Rows accept different counts,
so every cache (the base's, the EAGLE3 draft's, a draft model's) keeps a length per row and
places a row's tokens at its own slots and RoPE positions (layers.decode_attention.DecodeCache):
each row's output is the one it gets alone. A row that has finished (end-of-turn id or
max_new_tokens) leaves the batch: every cache and the drafter drop its row (keep_rows), so
later rounds compute the unfinished rows only. Drafters: EAGLE3,
Medusa, or prompt lookup (n-gram). The emitted sequence is the base's own greedy
continuation, so it matches generation.plain_generate token for token (up to float ties
between a k+1-token and a 1-token forward). A separate GPT of the target's vocabulary can
draft instead (`drafter_kind="draft-model"`, draft_model_drafter.py).

With `tree=TreeSpec(top_k, max_nodes)` the last stage drafts a tree of depth k per row
instead (tree.py; the drafters grow one row's tree at a time), all stages verify every row's
[pending, nodes] in one base forward under the tree masks (padded to the largest tree), the
fused tree op picks each row's accepted path (greedy: the deepest matching path; sampling:
recursive rejection over siblings), and every stage moves each row's path's cache entries
to the slots after its pending token (StageRunner.compact) rather than recomputing them: a
copy of a + 1 entries per layer instead of another base forward. Rows accept ragged path
lengths, as with chains. Sampled trees are lossless: one-hot (greedy) trees, or with draft
probabilities trees whose siblings are i.i.d. draws from their parent's distribution
(tree.sample_tree: the contract of acceptance.tree_verify).

Drafter interface (last stage): `start(prompt [b, P] left-padded, lengths [b], pending
[b, 1], prefill states, max_length)`; `propose(k, policy)` -> drafts [b, n], counts [b]
(`propose_sampled` adds their distributions); `propose_tree(k, spec, floor, row)` ->
DraftTree (`propose_tree_sampled` adds the nodes' distributions); `accept(tokens [b, s],
counts [b], states)`:
the tokens each row kept since the drafter last read, left-padded (the last counts[b] of
row b are real), with the base states at the same positions.
"""

from dataclasses import dataclass, field
from typing import Dict, List

import time
from functools import partial

import torch

from megatron_specdec.acceptance import (
    greedy_chain_verify,
    stochastic_chain_verify,
    tree_verify,
    typical_verify,
)
from megatron_specdec.inference.base_runner import BaseOutput, BaseRunner
from megatron_specdec.inference.draft_policy import DraftPolicy
from megatron_specdec.inference.sampling import Sampling, TypicalAcceptance
from megatron_specdec.inference.tree import TreeSpec, ancestors, verify_layout


@dataclass
class GenerationResult:
    tokens: List[int]
    accepted: List[int] = field(default_factory=list)  # accepted drafts per verify forward
    num_draft_tokens: int = 0  # chain length, or tree depth
    drafted: List[int] = field(default_factory=list)  # drafts per verify forward
    # Wall seconds in drafting (propose, and the drafter reading accepted states), in base
    # forwards (prefill and verify), and in all (the rest is acceptance and bookkeeping), of
    # the whole batch (one dict shared by its rows).
    seconds: Dict[str, float] = field(
        default_factory=lambda: {"draft": 0.0, "base": 0.0, "total": 0.0})
    # Rows of the batch each verify forward computed (finished rows leave it), one list
    # shared by the batch's rows.
    batch_rows: List[int] = field(default_factory=list)


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
        from megatron_specdec.methods.draft_model.proposer import (
            DraftModelDrafter,
            load_draft_model,
        )

        # In the target's dtype, as vLLM runs a draft model (a bf16 draft beside an fp32
        # target runs the slower bf16 kernels on the 2-core CPU: a SmolLM2 step 52 ms vs 39).
        draft = load_draft_model(draft_model, model.vocab_size,
                                 dtype=model.base.config.params_dtype)
        return DraftModelDrafter(draft, model.vocab_size) if ps.is_pipeline_last_stage() else None
    if kind == "ngram":
        from megatron_specdec.methods.ngram.proposer import NgramDrafter

        return NgramDrafter() if ps.is_pipeline_last_stage() else None
    if kind == "medusa":
        if not ps.is_pipeline_last_stage():
            return None
        from megatron_specdec.methods.medusa.proposer import MedusaDrafter

        return MedusaDrafter(model)
    from megatron_specdec.methods.eagle3.proposer import Eagle3Drafter
    from megatron_specdec.inference.embedding import last_stage_embedding

    embedding = last_stage_embedding(model)
    return Eagle3Drafter(model, embedding) if ps.is_pipeline_last_stage() else None


def draft_vocab_size(model) -> int:
    return model.vocab_size if model.algo == "medusa" else model.spec_config.draft_vocab_size


class SpeculativeGenerator:
    """Build once per model (the EAGLE3 embedding replica is loaded here), then `generate`.
    `tree`: draft a tree of depth num_draft_tokens with this branching instead of a chain.
    `policy`: "adaptive" (draft while confident, default) or "fixed" (always k), or a
    DraftPolicy. `drafter_kind`: eagle3, medusa, ngram or draft-model (default: the model's
    module); `draft_model`: the draft-model checkpoint. `typical`: verify sampled Medusa
    chains with typical acceptance (sampling.TypicalAcceptance: lossy) instead of rejection
    sampling."""

    def __init__(self, model, num_draft_tokens: int = None, drafter=None,
                 tree: TreeSpec = None, policy="adaptive", drafter_kind: str = None,
                 draft_model=None, typical: TypicalAcceptance = None):
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
        if typical is not None:
            kind = check_drafter_kind(model, drafter_kind)
            if kind != "medusa":
                raise ValueError(f"typical acceptance is Medusa's (a chain of heads' top "
                                 f"tokens); drafter {kind!r} verifies by rejection sampling")
            if tree is not None:
                raise ValueError("typical acceptance verifies chains; drop the tree")
        self.typical = typical
        self.drafter = drafter if drafter is not None else \
            build_drafter(model, drafter_kind, draft_model)

    def generate(self, prompt_ids, max_new_tokens: int, eos_ids=(),
                 sampling: Sampling = None) -> GenerationResult:
        """One prompt's continuation: `generate_batch` of a batch of one."""
        return self.generate_batch([prompt_ids], max_new_tokens, eos_ids, sampling)[0]

    @torch.no_grad()
    def generate_batch(self, prompts, max_new_tokens: int, eos_ids=(),
                       sampling: Sampling = None) -> List[GenerationResult]:
        """Continuations of `prompts` (lists of token ids), each row stopping at any id in
        `eos_ids` (not included) or after `max_new_tokens`: greedy, or sampled losslessly
        with `sampling` (chains and trees: drafts sampled from the draft's distribution, or
        proposed one-hot, are accepted by rejection sampling, so the output has plain
        sampling's distribution; a seed reproduces the batch's output); `self.typical`:
        Medusa's typical acceptance instead (lossy). Every rank returns the results."""
        from megatron_specdec.distributed import device
        from megatron_specdec.inference.generation import left_pad

        tokens, lengths = left_pad(prompts, 0, device())  # names an empty prompt
        batch = tokens.shape[0]
        sampling = sampling if sampling is not None and not sampling.greedy else None
        if self.typical is not None and (sampling is None or sampling.top_k
                                         or sampling.top_p < 1):
            raise ValueError("typical acceptance needs a sampling temperature > 0 and no "
                             "top_k/top_p (it reads the target at the temperature only)")
        self._sampling = sampling
        self._rng = None if sampling is None else sampling.generator(device())
        started = time.perf_counter()
        k, drafter = self.k, self.drafter
        eos = set(int(e) for e in eos_ids)
        self._seconds = {"draft": 0.0, "base": 0.0, "total": 0.0}
        batch_rows = []
        results = [GenerationResult([], [], k, seconds=self._seconds, batch_rows=batch_rows)
                   for _ in range(batch)]
        done = [max_new_tokens <= 0] * batch
        clock = self._clock
        index = list(range(batch))  # the result each row of the computed batch feeds

        def emit(new, counts):
            """Append each computed row's first counts[b] tokens of new [b, s] (host lists)
            until its end-of-turn id or max_new_tokens."""
            for row, ids, n in zip(index, new, counts):
                for token in ids[:n]:
                    if token in eos:
                        done[row] = True
                        break
                    results[row].tokens.append(token)
                    if len(results[row].tokens) >= max_new_tokens:
                        done[row] = True
                        break

        def finish() -> List[GenerationResult]:
            self._seconds["total"] = time.perf_counter() - started
            return results

        if all(done):
            return finish()
        width = k if self.tree is None else self.tree.num_nodes(k)
        # A row holds at most prompt + max_new_tokens + k real tokens; a forward writes up to
        # width + 1 (or a drafter's catch-up of up to k + 1 + max_backoff) slots past them.
        max_length = (tokens.shape[1] + max_new_tokens + 2 * (width + 1)
                      + self.policy.max_backoff)
        runner = BaseRunner(self.model, batch, max_length)
        out = clock("base", partial(runner.step, last_only=True, counts=lengths), tokens)
        pending = torch.zeros(batch, 1, dtype=torch.long, device=tokens.device)
        if runner.last:
            last = out.logits[:, -1]
            # Typical acceptance emits the target's argmax after the drafts, as here.
            pending[:, 0] = last.argmax(-1) if sampling is None or self.typical else \
                sampling.sample(last, self._rng)
            clock("draft", drafter.start, tokens, lengths, pending, out, max_length)
        runner.broadcast_from_last(pending)
        emit(pending.tolist(), [1] * batch)
        verify = self._verify_chain if self.tree is None else self._verify_tree
        self._unread, self._skip, self._backoff = [], 0, 0
        while True:
            # Finished rows leave the batch: later rounds compute the others only.
            live = [row for row, i in enumerate(index) if not done[i]]
            if not live:
                return finish()
            if len(live) < len(index):
                rows = torch.tensor(live)
                runner.keep_rows(rows)
                pending = pending[rows.to(pending.device)]
                if runner.last:
                    self._keep_rows(rows)
                index = [index[row] for row in live]
            start = runner.lengths.clone()
            accepted, drafted, new, out = verify(runner, pending)
            batch_rows.append(len(index))
            for row, a, d in zip(index, accepted.tolist(), drafted.tolist()):
                results[row].accepted.append(a)
                results[row].drafted.append(d)
            kept = accepted + 1
            runner.rewind(runner.lengths - start - kept.cpu())
            emit(new.tolist(), kept.tolist())
            if runner.last:
                self._unread.append((new, kept, out))
            pending = new.gather(1, accepted[:, None])

    def _keep_rows(self, rows):
        """The last stage's drafter and unread rounds keep the batch rows `rows` only."""
        self.drafter.keep_rows(rows)
        self._unread = [(new.index_select(0, rows.to(new.device)),
                         kept.index_select(0, rows.to(kept.device)), out.rows(rows))
                        for new, kept, out in self._unread]

    def _draft(self, k: int):
        """The last stage's drafts [b, n] and per-row counts [b] for this round: none while
        sitting out a backoff (draft_policy.py); otherwise the drafter first reads the base
        states it has not seen. Sampled drafts leave their distributions in `_draft_probs`
        for `_accept`."""
        self._draft_probs = None
        if self._skip:
            self._skip -= 1
            batch = self._unread[0][0].shape[0]
            none = torch.zeros(batch, 0, dtype=torch.long, device=self._unread[0][0].device)
            return none, none.new_zeros(batch)
        self._catch_up()
        s = self._sampling
        if s is not None and not s.one_hot_drafts and hasattr(self.drafter, "propose_sampled"):
            drafts, counts, self._draft_probs = self._clock(
                "draft", self.drafter.propose_sampled, k, self.policy, s, self._rng)
        else:
            drafts, counts = self._clock("draft", self.drafter.propose, k, self.policy)
        if not getattr(self.drafter, "free_to_probe", False):
            self._backoff = self._skip = self.policy.next_backoff(self._backoff,
                                                                  drafts.shape[1])
        return drafts, counts

    def _catch_up(self):
        """The drafter reads the kept tokens and base states of the rounds it has not seen,
        in one call: per row, its kept positions of every round moved to the end (stable, so
        in order), the rest in front as padding."""
        if self._unread:
            tokens = torch.cat([t for t, _, _ in self._unread], dim=1)
            kept = torch.cat([torch.arange(t.shape[1], device=t.device) < c[:, None]
                              for t, c, _ in self._unread], dim=1)
            order = kept.long().argsort(dim=1, stable=True)
            states = BaseOutput.cat([o for _, _, o in self._unread]).take(order)
            # Rejected positions hold -1: padding needs a valid id.
            self._clock("draft", self.drafter.accept, tokens.gather(1, order).clamp_min(0),
                        kept.sum(1), states)
            self._unread = []

    def _clock(self, part: str, fn, *args):
        """fn(*args), its wall time added to the current batch's `seconds[part]`."""
        start = time.perf_counter()
        value = fn(*args)
        self._seconds[part] += time.perf_counter() - start
        return value

    def _verify_chain(self, runner, pending):
        """One round: each row drafts up to k, all verify in one forward. Returns
        (accepted [b], drafted [b], the verdict [b, n + 1]: row b's emitted tokens first,
        then -1, and the base states of the n + 1 positions (last stage)). The caller
        rewinds."""
        k, batch = self.k, pending.shape[0]
        proposal = torch.zeros(batch, k + 1, dtype=torch.long, device=pending.device)
        if runner.last:  # the drafts, then their counts: one broadcast
            drafts, counts = self._draft(k)
            proposal[:, : drafts.shape[1]] = drafts
            proposal[:, k] = counts
        runner.broadcast_from_last(proposal)
        counts = proposal[:, k]
        n = int(counts.max())
        drafts = proposal[:, :n]
        out = self._clock("base", runner.step, torch.cat([pending, drafts], dim=1))
        verdict = torch.zeros(batch, n + 2, dtype=torch.long, device=pending.device)
        if runner.last:
            verdict[:, : n + 1], verdict[:, -1] = self._accept(drafts, counts, out.logits)
        runner.broadcast_from_last(verdict)
        return verdict[:, -1], counts, verdict[:, : n + 1], out

    def _accept(self, drafts, counts, logits):
        """(emitted tokens [b, n + 1] padded with -1, accepted counts [b]) of a chain of
        counts[b] drafts per row."""
        if self._sampling is None:
            return greedy_chain_verify(drafts, logits.argmax(-1), counts)
        s = self._sampling
        if self.typical is not None:
            return typical_verify(drafts, logits, counts, temperature=s.temperature,
                                  eps=self.typical.eps, alpha=self.typical.alpha)
        probs = self._draft_probs
        if probs is not None:
            probs = probs[:, : drafts.shape[1]] if drafts.shape[1] else None
        return stochastic_chain_verify(drafts, logits, counts, draft_probs=probs,
                                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                       generator=self._rng)

    def _propose_trees(self, k: int, batch: int):
        """The last stage's draft tree of each row: sampled from the draft's distribution
        when sampling with a drafter that has one (the nodes' distributions left in
        `_draft_probs`, per row), otherwise the greedy tree (one-hot drafts: lossless too,
        tree.py)."""
        s, floor = self._sampling, self.policy.tree_floor
        sampled = s is not None and not s.one_hot_drafts and hasattr(self.drafter,
                                                                     "propose_tree_sampled")
        trees, self._draft_probs = [], [] if sampled else None
        for row in range(batch):
            if sampled:
                tree, probs = self.drafter.propose_tree_sampled(k, self.tree, floor, s,
                                                                self._rng, row)
                trees.append(tree)
                self._draft_probs.append(probs)
            else:
                trees.append(self.drafter.propose_tree(k, self.tree, floor, row))
        return trees

    def _accept_tree(self, tokens, parents, logits, sizes):
        """tree_verify over one tree per row ([b, m], sizes[b] nodes each): greedy, or
        recursive rejection sampling over siblings (against the nodes' draft
        distributions, or one-hot). Width: tokens [b, d + 1], path [b, d], d = min(k, m)."""
        s, depth = self._sampling, min(self.k, tokens.shape[1])
        if s is None:
            return tree_verify(tokens, parents, logits, sizes, max_depth=depth)
        probs = None
        if self._draft_probs is not None and tokens.shape[1]:
            vocab = logits.shape[-1]
            probs = logits.new_zeros(tokens.shape + (vocab,), dtype=torch.float64)
            for row, q in enumerate(self._draft_probs):
                probs[row, : q.shape[0]] = q
        return tree_verify(tokens, parents, logits, sizes, draft_probs=probs,
                           temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                           max_depth=depth, generator=self._rng)

    def _verify_tree(self, runner, pending):
        """The same round over a draft tree per row of up to n nodes (none: a plain
        step), all rows in one forward, each tree after its own row's cache; every row's
        accepted path's cache entries are compacted after its pending token, so the verdict
        and states cover pending and the path alone."""
        k, n, batch = self.k, self.tree.num_nodes(self.k), pending.shape[0]
        # Per row: tokens, parents (padding: -1, a root child nothing reads), then the node
        # count and depth in the last column: one broadcast.
        tree = torch.zeros(batch, 2, n + 1, dtype=torch.long, device=pending.device)
        tree[:, 1, :n] = -1
        if runner.last:
            self._catch_up()
            trees = self._clock("draft", self._propose_trees, k, batch)
            for row, drafted in enumerate(trees):
                m = drafted.tokens.numel()
                tree[row, 0, :m], tree[row, 1, :m] = drafted.tokens, drafted.parents
                tree[row, 0, n] = m
                tree[row, 1, n] = int(ancestors(drafted.parents).sum(1).max()) if m else 0
        runner.broadcast_from_last(tree)
        sizes, depth = tree[:, 0, n], tree[:, 1, n]
        m = int(sizes.max())
        tokens, parents = tree[:, 0, :m], tree[:, 1, :m]
        start = runner.lengths.clone()  # each row's pending slot
        positions, mask = verify_layout(parents, start)
        out = self._clock("base", runner.step, torch.cat([pending, tokens], dim=1), positions,
                          mask)
        verdict = torch.zeros(batch, 2 * k + 2, dtype=torch.long, device=pending.device)
        if runner.last:
            emitted, counts, path = self._accept_tree(tokens, parents, out.logits, sizes)
            d = path.shape[1]
            verdict[:, : d + 1], verdict[:, k + 1: k + 1 + d] = emitted, path
            verdict[:, -1] = counts
        runner.broadcast_from_last(verdict)
        accepted = verdict[:, -1]
        width = int(accepted.max())
        path = verdict[:, k + 1: k + 1 + width].clamp_min(0)
        runner.compact(start + 1, start[:, None].to(path.device) + 1 + path, accepted)
        kept = torch.cat([path.new_zeros(batch, 1), path + 1], dim=1)
        states = out.take(kept) if runner.last else None
        return accepted, depth, verdict[:, : width + 1], states

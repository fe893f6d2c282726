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
draft instead (`drafter_kind="draft_model"`, methods/draft_model/proposer.py).

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

The drafter is the draft method's proposer (registry.get(name).proposer), typed by the
registry's Proposer protocols: Proposer (start, propose, accept, keep_rows), SampledProposer
(propose_sampled: drafts with their distributions), TreeProposer and SampledTreeProposer.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import time
from functools import partial

import torch

from megatron_specdec import registry
from megatron_specdec.acceptance import (
    greedy_chain_verify,
    stochastic_chain_verify,
    tree_verify,
    typical_verify,
)
from megatron_specdec.inference.base_runner import BaseOutput, BaseRunner
from megatron_specdec.inference.draft_policy import DraftPolicy
from megatron_specdec.inference.generation import left_pad
from megatron_specdec.inference.sampling import Sampling, TypicalAcceptance
from megatron_specdec.inference.tree import TreeSpec, ancestors, verify_layout
from megatron_specdec.models.weight_memory import place_weights


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


@dataclass
class _Call:
    """One generate_batch call's state (the generator itself keeps only its settings, so it
    serves calls one after another, each starting clean): sampling settings and their
    generator, the wall-clock split, the rounds the drafter has not read yet, the draft
    policy's backoff, and the last drafts' distributions."""
    sampling: Optional[Sampling]
    rng: Optional[torch.Generator]
    seconds: Dict[str, float] = field(
        default_factory=lambda: {"draft": 0.0, "base": 0.0, "total": 0.0})
    unread: list = field(default_factory=list)
    skip: int = 0
    backoff: int = 0
    draft_probs: object = None

    def clock(self, part: str, fn, *args):
        """fn(*args), its wall time added to `seconds[part]`."""
        start = time.perf_counter()
        value = fn(*args)
        self.seconds[part] += time.perf_counter() - start
        return value


def default_num_draft_tokens(model) -> int:
    return registry.get(model.algo).default_num_draft_tokens(model.spec_config)


def drafters() -> tuple:
    """The methods that can draft (registry names with a proposer)."""
    return tuple(n for n in registry.names() if registry.get(n).proposer is not None)


def check_drafter_kind(model, kind: str = None) -> registry.DraftMethod:
    """The method `kind` names, or the model's own draft module's when None, if this model
    can draft with it."""
    kind = kind or model.algo
    if kind not in drafters():
        raise ValueError(f"drafter {kind!r}; expected one of {drafters()}")
    method = registry.get(kind)
    if method.needs_module and method is not model.method:
        raise ValueError(f"drafter {kind!r} needs a model whose draft module is {kind}; "
                         f"this one's is {model.algo}")
    return method


def build_drafter(model, kind: str = None, draft_model=None):
    """This stage's drafter of `kind` (default: the model's own draft module; None before the
    last stage); `draft_model`: the draft checkpoint a method that needs one reads.
    Collective over the pipeline (over the world for a draft model)."""
    method = check_drafter_kind(model, kind)
    if method.needs_draft_checkpoint != (draft_model is not None):
        raise ValueError(f"--draft-model goes with a drafter that reads a draft checkpoint "
                         f"(draft_model), and it needs one; drafter {method.name!r}")
    return method.proposer(model, registry.ProposerOptions(draft_model=draft_model))


def draft_vocab_size(model) -> int:
    return registry.get(model.algo).draft_vocab_size(model)


class SpeculativeGenerator:
    """Build once per model (the drafter, e.g. EAGLE3's embedding replica, is made here), then
    `generate`. `tree`: draft a tree of depth num_draft_tokens with this branching instead of
    a chain. `policy`: "adaptive" (draft while confident, default) or "fixed" (always k), or a
    DraftPolicy. `drafter_kind`: a registry method that drafts (registry names: eagle3,
    medusa, ngram, draft_model, ...; default: the model's module); `draft_model`: the draft
    checkpoint of a method that needs one. `typical`: verify sampled chains of a method that
    allows it (Medusa) with typical acceptance (sampling.TypicalAcceptance: lossy) instead of
    rejection sampling. `prompt_bucket`: prompt batches are padded to a multiple of this many
    tokens (generation.left_pad), so the base's and drafter's prefills meet few shapes.
    Calls run one after another; each starts from a clean state (the drafter restarts per
    call)."""

    def __init__(self, model, num_draft_tokens: int = None, drafter=None,
                 tree: TreeSpec = None, policy="adaptive", drafter_kind: str = None,
                 draft_model=None, typical: TypicalAcceptance = None,
                 prompt_bucket: Optional[int] = None):
        place_weights(model)  # base and draft weights as one stream (StageRunner: the base)
        self.model = model
        self.prompt_bucket = prompt_bucket
        self.k = (default_num_draft_tokens(model) if num_draft_tokens is None
                  else num_draft_tokens)
        method = check_drafter_kind(model, drafter_kind)
        if method.check_num_draft_tokens is not None:
            method.check_num_draft_tokens(model.spec_config, self.k)
        self.policy = policy if isinstance(policy, DraftPolicy) else \
            DraftPolicy.named(policy, self.k)
        if tree is not None:
            if not method.drafts_trees:
                raise ValueError(f"the {method.name} drafter drafts chains, not trees")
            tree.check(self.k, draft_vocab_size(model))
        self.tree = tree
        if typical is not None:
            if not method.typical_acceptance:
                raise ValueError(f"typical acceptance is Medusa's (a chain of heads' top "
                                 f"tokens); drafter {method.name!r} verifies by rejection "
                                 f"sampling")
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

        # left_pad names an empty prompt.
        tokens, lengths = left_pad(prompts, 0, device(), self.prompt_bucket)
        sampling = sampling if sampling is not None and not sampling.greedy else None
        if self.typical is not None and (sampling is None or sampling.top_k
                                         or sampling.top_p < 1):
            raise ValueError("typical acceptance needs a sampling temperature > 0 and no "
                             "top_k/top_p (it reads the target at the temperature only)")
        call = _Call(sampling, None if sampling is None else sampling.generator(device()))
        started = time.perf_counter()
        batch_rows = []
        results = [GenerationResult([], [], self.k, seconds=call.seconds, batch_rows=batch_rows)
                   for _ in range(tokens.shape[0])]
        if max_new_tokens > 0:
            self._rounds(call, tokens, lengths, max_new_tokens, set(int(e) for e in eos_ids),
                         results)
        call.seconds["total"] = time.perf_counter() - started
        return results

    def _rounds(self, call: _Call, tokens, lengths, max_new_tokens: int, eos: set, results):
        """Prefill, then draft-and-verify rounds until every row is done; fills `results`."""
        k, batch = self.k, tokens.shape[0]
        done = [False] * batch
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

        width = k if self.tree is None else self.tree.num_nodes(k)
        # A row holds at most prompt + max_new_tokens + k real tokens; a forward writes up to
        # width + 1 (or a drafter's catch-up of up to k + 1 + max_backoff) slots past them.
        max_length = (tokens.shape[1] + max_new_tokens + 2 * (width + 1)
                      + self.policy.max_backoff)
        runner = BaseRunner(self.model, batch, max_length)
        pending = self._prefill(call, runner, tokens, lengths, max_length)
        emit(pending.tolist(), [1] * batch)
        verify = self._verify_chain if self.tree is None else self._verify_tree
        # Greedy chain rounds the policy sits out skip the verify bookkeeping (_idle_round);
        # only the last stage knows when, so one stage must hold the whole model.
        idle_rounds = self.tree is None and call.sampling is None and runner.single_stage
        while True:
            # Finished rows leave the batch: later rounds compute the others only.
            live = [row for row, i in enumerate(index) if not done[i]]
            if not live:
                return
            if len(live) < len(index):
                rows = torch.tensor(live)
                runner.keep_rows(rows)
                pending = pending[rows.to(pending.device)]
                if runner.last:
                    self._keep_rows(call, rows)
                index = [index[row] for row in live]
            idle = idle_rounds and call.skip > 0
            start = None if idle else runner.lengths.clone()
            accepted, drafted, new, out = (self._idle_round if idle else verify)(
                call, runner, pending)
            results[0].batch_rows.append(len(index))
            for row, a, d in zip(index, accepted.tolist(), drafted.tolist()):
                results[row].accepted.append(a)
                results[row].drafted.append(d)
            kept = accepted + 1
            if not idle:  # an idle round wrote its one kept token only
                runner.rewind(runner.lengths - start - kept.cpu())
            emit(new.tolist(), kept.tolist())
            if runner.last:
                call.unread.append((new, kept, out))
            pending = new.gather(1, accepted[:, None])

    def _prefill(self, call: _Call, runner, tokens, lengths, max_length: int):
        """The prompts through the base, the first token of each row (on every rank), and the
        drafter started on the prefill's states (last stage)."""
        greedy = call.sampling is None
        out = call.clock("base", partial(runner.step, last_only=True, counts=lengths,
                                         greedy=greedy), tokens)
        pending = torch.zeros(tokens.shape[0], 1, dtype=torch.long, device=tokens.device)
        if runner.last:
            if greedy:
                pending[:, 0] = out.ids[:, -1]
            else:
                last = out.logits[:, -1]
                # Typical acceptance emits the target's argmax after the drafts, as here.
                pending[:, 0] = last.argmax(-1) if self.typical else \
                    call.sampling.sample(last, call.rng)
            call.clock("draft", self.drafter.start, tokens, lengths, pending, out, max_length)
        runner.broadcast_from_last(pending)
        return pending

    def _keep_rows(self, call: _Call, rows):
        """The last stage's drafter and unread rounds keep the batch rows `rows` only."""
        self.drafter.keep_rows(rows)
        call.unread = [(new.index_select(0, rows.to(new.device)),
                         kept.index_select(0, rows.to(kept.device)), out.rows(rows))
                        for new, kept, out in call.unread]

    def _draft(self, call: _Call, k: int):
        """The last stage's drafts [b, n] and per-row counts [b] for this round: none while
        sitting out a backoff (draft_policy.py); otherwise the drafter first reads the base
        states it has not seen. Sampled drafts leave their distributions in `_draft_probs`
        for `_accept`."""
        call.draft_probs = None
        if call.skip:
            call.skip -= 1
            batch = call.unread[0][0].shape[0]
            none = torch.zeros(batch, 0, dtype=torch.long, device=call.unread[0][0].device)
            return none, none.new_zeros(batch)
        self._catch_up(call)
        s = call.sampling
        if s is not None and not s.one_hot_drafts and isinstance(self.drafter,
                                                                  registry.SampledProposer):
            drafts, counts, call.draft_probs = call.clock(
                "draft", self.drafter.propose_sampled, k, self.policy, s, call.rng)
        else:
            drafts, counts = call.clock("draft", self.drafter.propose, k, self.policy)
        if not getattr(self.drafter, "free_to_probe", False):
            call.backoff = call.skip = self.policy.next_backoff(call.backoff,
                                                                  drafts.shape[1])
        return drafts, counts

    def _catch_up(self, call: _Call):
        """The drafter reads the kept tokens and base states of the rounds it has not seen,
        in one call: per row, its kept positions of every round moved to the end (stable, so
        in order), the rest in front as padding."""
        if call.unread:
            tokens = torch.cat([t for t, _, _ in call.unread], dim=1)
            kept = torch.cat([torch.arange(t.shape[1], device=t.device) < c[:, None]
                              for t, c, _ in call.unread], dim=1)
            order = kept.long().argsort(dim=1, stable=True)
            states = BaseOutput.cat([o for _, _, o in call.unread]).take(order)
            # Rejected positions hold -1: padding needs a valid id.
            call.clock("draft", self.drafter.accept, tokens.gather(1, order).clamp_min(0),
                        kept.sum(1), states)
            call.unread = []

    def _idle_round(self, call: _Call, runner, pending):
        """A greedy chain round the policy sits out: the pending token's plain step, with no
        proposal to broadcast, no verify op and nothing to rewind (a round through
        `_verify_chain` with no drafts cost ~4.5% more than a plain step: RESULTS.md). Returns
        what `_verify_chain` returns."""
        call.skip -= 1
        out = call.clock("base", partial(runner.step, greedy=True), pending)
        none = torch.zeros(pending.shape[0], dtype=torch.long, device=pending.device)
        return none, none, out.ids, out

    def _verify_chain(self, call: _Call, runner, pending):
        """One round: each row drafts up to k, all verify in one forward. Returns
        (accepted [b], drafted [b], the verdict [b, n + 1]: row b's emitted tokens first,
        then -1, and the base states of the n + 1 positions (last stage)). The caller
        rewinds."""
        k, batch = self.k, pending.shape[0]
        proposal = torch.zeros(batch, k + 1, dtype=torch.long, device=pending.device)
        if runner.last:  # the drafts, then their counts: one broadcast
            drafts, counts = self._draft(call, k)
            proposal[:, : drafts.shape[1]] = drafts
            proposal[:, k] = counts
        runner.broadcast_from_last(proposal)
        counts = proposal[:, k]
        n = int(counts.max())
        drafts = proposal[:, :n]
        out = call.clock("base", partial(runner.step, greedy=call.sampling is None),
                         torch.cat([pending, drafts], dim=1))
        verdict = torch.zeros(batch, n + 2, dtype=torch.long, device=pending.device)
        if runner.last:
            verdict[:, : n + 1], verdict[:, -1] = self._accept(call, drafts, counts, out)
        runner.broadcast_from_last(verdict)
        return verdict[:, -1], counts, verdict[:, : n + 1], out

    def _accept(self, call: _Call, drafts, counts, out: BaseOutput):
        """(emitted tokens [b, n + 1] padded with -1, accepted counts [b]) of a chain of
        counts[b] drafts per row, from the verify forward's argmax ids (greedy) or logits."""
        if call.sampling is None:
            return greedy_chain_verify(drafts, out.ids, counts)
        s, logits = call.sampling, out.logits
        if self.typical is not None:
            return typical_verify(drafts, logits, counts, temperature=s.temperature,
                                  eps=self.typical.eps, alpha=self.typical.alpha)
        probs = call.draft_probs
        if probs is not None:
            probs = probs[:, : drafts.shape[1]] if drafts.shape[1] else None
        return stochastic_chain_verify(drafts, logits, counts, draft_probs=probs,
                                       temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                       generator=call.rng)

    def _propose_trees(self, call: _Call, k: int, batch: int):
        """The last stage's draft tree of each row: sampled from the draft's distribution
        when sampling with a drafter that has one (the nodes' distributions left in
        `_draft_probs`, per row), otherwise the greedy tree (one-hot drafts: lossless too,
        tree.py)."""
        s, floor = call.sampling, self.policy.tree_floor
        sampled = s is not None and not s.one_hot_drafts and isinstance(
            self.drafter, registry.SampledTreeProposer)
        trees, call.draft_probs = [], [] if sampled else None
        for row in range(batch):
            if sampled:
                tree, probs = self.drafter.propose_tree_sampled(k, self.tree, floor, s,
                                                                call.rng, row)
                trees.append(tree)
                call.draft_probs.append(probs)
            else:
                trees.append(self.drafter.propose_tree(k, self.tree, floor, row))
        return trees

    def _accept_tree(self, call: _Call, tokens, parents, logits, sizes):
        """tree_verify over one tree per row ([b, m], sizes[b] nodes each): greedy, or
        recursive rejection sampling over siblings (against the nodes' draft
        distributions, or one-hot). Width: tokens [b, d + 1], path [b, d], d = min(k, m)."""
        s, depth = call.sampling, min(self.k, tokens.shape[1])
        if s is None:
            return tree_verify(tokens, parents, logits, sizes, max_depth=depth)
        probs = None
        if call.draft_probs is not None and tokens.shape[1]:
            vocab = logits.shape[-1]
            probs = logits.new_zeros(tokens.shape + (vocab,), dtype=torch.float64)
            for row, q in enumerate(call.draft_probs):
                probs[row, : q.shape[0]] = q
        return tree_verify(tokens, parents, logits, sizes, draft_probs=probs,
                           temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                           max_depth=depth, generator=call.rng)

    def _verify_tree(self, call: _Call, runner, pending):
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
            self._catch_up(call)
            trees = call.clock("draft", self._propose_trees, call, k, batch)
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
        out = call.clock("base", runner.step, torch.cat([pending, tokens], dim=1), positions,
                          mask)
        verdict = torch.zeros(batch, 2 * k + 2, dtype=torch.long, device=pending.device)
        if runner.last:
            emitted, counts, path = self._accept_tree(call, tokens, parents, out.logits, sizes)
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

"""The decoding runtime's kernels and cache in one process (small seeded random Llama): every
candidate product of the decoding linears equals F.linear at every row count and returns a
tensor a tensor-parallel all-reduce can work on in place; the kernel choice is measured once
per shape, read back from its cache, keeps the row-invariant product within its margin and
refuses a foreign or stale cache; on the skinny product a verify forward's logits equal plain
steps' bitwise and every drafter's speculative output equals greedy; the adaptive threshold
is the measured cost ratio; the SDPA inference attention equals megatron's
DotProductAttention (grouped queries, arbitrary mask); a decode over the rotated-key cache
equals one full forward; a left-padded batch gives each row its batch-1 greedy output, and
rows that finish leave a greedy batch without changing the others'; padding never puts NaN in
the cache."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_specdec import distributed
from test_speculative_generation import HF, build


@pytest.fixture(scope="module")
def model():
    distributed.initialize(1, 1)
    return build("eagle3")


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 128, 300])
def test_every_product_equals_f_linear(rows):
    from megatron_specdec.models.layers.linear_kernels import candidates, CANDIDATES
    from megatron_specdec.models.layers.small_rows_linear import rows_linear

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 96, generator=g)[:, :, :64]  # a non-contiguous input
    w = torch.randn(80, 64, generator=g)
    outs = [CANDIDATES[name](x, w) for name in candidates(torch.float32)] + [rows_linear(x, w)]
    for out in outs:
        assert out.shape == (rows, 1, 80) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.fixture
def choice_cache(tmp_path, monkeypatch):
    """An empty cache directory; measurements are counted, not run (fixed timings)."""
    from megatron_specdec.models.layers import linear_kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv(linear_kernels.PIN_ENV, raising=False)
    measured = []

    def fake_times(out_features, in_features, dtype, plan):
        measured.append((out_features, in_features))
        # The skinny op's one-row blocks faster at 1 row, its ISA blocks at every other count;
        # f_linear as fast as the faster of the two, weight_left slower at every count.
        times = {}
        for b, names in plan.items():
            for name in names:
                times.setdefault(name, {})[b] = 2.0 if name == "weight_left" or (name, b == 1) in (
                    ("skinny", True), ("skinny_row", False)) else 1.0
        return times

    monkeypatch.setattr(linear_kernels, "time_candidates", fake_times)
    linear_kernels.reset()
    yield linear_kernels, measured
    linear_kernels.reset()


def test_kernel_choice_is_measured_once_then_read_from_the_cache(choice_cache):
    kernels, measured = choice_cache
    w = torch.randn(24, 16)
    small = [kernels.product(w, rows) for rows in range(1, kernels.INVARIANT_ROWS + 1)]
    if "skinny" in kernels.candidates(w.dtype):
        # One row-invariant product, its fastest schedule at each count.
        assert small == [kernels.skinny_row] + [kernels.skinny] * (len(small) - 1)
        assert kernels.product(w, 100) is kernels.skinny
    else:
        assert small == [kernels.f_linear] * len(small)
    assert measured == [(24, 16)]
    kernels.reset()  # a new process: the choice comes from the file, nothing is timed
    assert kernels.product(w, 3) is small[2] and measured == [(24, 16)]
    path = kernels.cache_path(kernels.machine())
    assert json.loads(path.read_text())["machine"] == kernels.machine()


def test_kernel_choice_takes_the_row_invariant_product_however_fast_blas_is():
    """A BLAS product faster at every count still leaves rows 1-16 to the skinny op: a verify
    row and a step row must sum in one order (on an Intel Xeon MKL won the tiny matrices)."""
    from megatron_specdec.models.layers.linear_kernels import SMALL_BUCKETS, WIDE_BUCKETS, choose

    buckets = SMALL_BUCKETS + WIDE_BUCKETS
    far = {"skinny": {b: 2.0 for b in buckets}, "f_linear": {b: 1.0 for b in buckets}}
    assert set(choose(far)["small"].values()) == {"skinny"}
    assert choose(far)["wide"][32] == "f_linear"
    # The schedules compute the same bits: each count takes the fastest.
    schedules = {"skinny": {b: 1.0 if b > 4 else 1.5 for b in buckets},
                 "skinny_row": {b: 1.0 if b <= 2 else 1.5 for b in buckets},
                 "skinny_burst": {b: 0.9 if b == 4 else 1.5 for b in buckets},
                 "f_linear": {b: 0.5 for b in buckets}}
    assert choose(schedules)["small"] == {1: "skinny_row", 2: "skinny_row", 4: "skinny_burst",
                                          8: "skinny", 16: "skinny"}
    # Without the skinny op (another dtype): one product for every count, the best overall,
    # not the fastest at each.
    blas = {"f_linear": {b: 1.0 if b > 1 else 1.3 for b in buckets},
            "weight_left": {b: 1.2 if b > 1 else 1.0 for b in buckets}}
    assert set(choose(blas)["small"].values()) == {"f_linear"}


@pytest.mark.parametrize("foreign", [{"cpu": "Intel(R) Xeon(R) Platinum 8488C"},
                                     {"torch": "2.9.0+cpu"}, {"kernel": "0123456789abcdef"}])
def test_kernel_choice_refuses_a_foreign_entry_and_measures_again(choice_cache, foreign):
    kernels, measured = choice_cache
    key = kernels.machine()
    path = kernels.cache_path(key)
    path.parent.mkdir(parents=True)
    # A cache copied from another machine (or an older torch or kernel), at this one's path.
    path.write_text(json.dumps({"machine": {**key, **foreign}, "entries": {
        "24x16/float32": {"small": {str(b): "weight_left" for b in kernels.SMALL_BUCKETS},
                          "wide": {str(b): "weight_left" for b in kernels.WIDE_BUCKETS}}}}))
    fn = kernels.product(torch.randn(24, 16), 2)
    assert measured == [(24, 16)] and fn is not kernels.CANDIDATES["weight_left"]
    assert json.loads(path.read_text())["machine"] == key  # replaced by this machine's


def test_kernel_choice_bad_cache_and_pin(choice_cache, monkeypatch):
    kernels, measured = choice_cache
    path = kernels.cache_path(kernels.machine())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    kernels.product(torch.randn(24, 16), 1)
    assert measured == [(24, 16)]
    kernels.reset()
    monkeypatch.setenv(kernels.PIN_ENV, "weight_left")
    assert kernels.product(torch.randn(8, 4), 1) is kernels.weight_left
    # A dtype the skinny op does not take falls back to F.linear when it is pinned.
    kernels.reset()
    monkeypatch.setenv(kernels.PIN_ENV, "skinny")
    assert kernels.product(torch.randn(8, 4, dtype=torch.bfloat16), 1) is kernels.f_linear
    kernels.reset()
    monkeypatch.setenv(kernels.PIN_ENV, "mkl")
    with pytest.raises(ValueError, match="SPECDEC_LINEAR='mkl'; expected one of"):
        kernels.product(torch.randn(8, 4), 1)
    assert measured == [(24, 16)]


def test_sdpa_attention_equals_megatron_dot_product_attention(model):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_specdec.models.layers.decode_attention import SDPAttention, grouped_sdpa

    config = model.base.config
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.arbitrary,
                attention_type="self")
    ours, theirs = SDPAttention(**args).eval(), DotProductAttention(**args).eval()
    g = torch.Generator().manual_seed(0)
    heads, groups, d = (config.num_attention_heads, config.num_query_groups,
                        config.kv_channels)
    q = torch.randn(5, 2, heads, d, generator=g)
    k, v = torch.randn(2, 12, 2, groups, d, generator=g)
    mask = torch.rand(2, 1, 5, 12, generator=g) > 0.6
    mask[..., 7:] = torch.eye(5, dtype=torch.bool).logical_not()  # every row sees itself
    with torch.no_grad():
        got = ours(q, k, v, mask, AttnMaskType.arbitrary)
        want = theirs(q, k, v, mask, AttnMaskType.arbitrary)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert heads > groups  # the grouped path below is exercised
    for fold in (False, True):  # fold: what a GPU takes (query heads as rows of their group)
        out = grouped_sdpa(q, k, v, ~mask, False, ours.softmax_scale, fold)
        torch.testing.assert_close(out.reshape(want.shape), want, rtol=1e-5, atol=1e-5)


def test_decode_over_the_cache_equals_a_full_forward(model):
    from megatron_specdec.inference.generation import StageRunner

    tokens = torch.randint(0, HF["vocab_size"], (1, 30), generator=torch.Generator().manual_seed(3))
    full = StageRunner(model.base, 1, 30, HF["vocab_size"]).step(tokens)
    runner = StageRunner(model.base, 1, 30, HF["vocab_size"])
    parts = [runner.step(tokens[:, :10]), runner.step(tokens[:, 10:11])]
    runner.rewind(1)  # a rejected draft: its slot is overwritten
    parts[-1] = runner.step(tokens[:, 10:11])
    parts.append(runner.step(tokens[:, 11:]))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


@pytest.fixture
def skinny_everywhere(monkeypatch):
    from megatron_specdec.models.layers import linear_kernels

    if "skinny" not in linear_kernels.candidates(torch.float32):
        pytest.skip("megatron_specdec._C is not built with skinny_linear")
    monkeypatch.setenv(linear_kernels.PIN_ENV, "skinny")
    linear_kernels.reset()
    yield
    linear_kernels.reset()


def test_verify_forward_equals_plain_steps_bitwise(model, skinny_everywhere):
    """On the row-invariant product, the logits of a k+1-token verify forward are bitwise those
    of k+1 plain one-token steps: speculative output equals greedy by construction."""
    from megatron_specdec.inference.generation import StageRunner

    tokens = torch.randint(0, HF["vocab_size"], (1, 28), generator=torch.Generator().manual_seed(6))
    verify, steps = (StageRunner(model.base, 1, 28, HF["vocab_size"]) for _ in range(2))
    verify.step(tokens[:, :20])
    steps.step(tokens[:, :20])
    together = verify.step(tokens[:, 20:])
    alone = torch.cat([steps.step(tokens[:, i: i + 1]) for i in range(20, 28)], dim=1)
    assert torch.equal(together, alone), (together - alone).abs().max()


def test_speculative_equals_greedy_on_the_skinny_product(skinny_everywhere, tmp_path):
    """Every drafter (EAGLE3, Medusa, n-gram; oracle with planned rejections) on the
    row-invariant product."""
    from test_speculative_generation import identity_worker

    out = tmp_path / "out.pt"
    distributed.spawn(identity_worker, 1, 1, 1, str(out))
    for algo, got in torch.load(out, weights_only=False).items():
        assert got["plain"].tokens == got["greedy"], algo
        if "oracle" in got:
            assert got["oracle"].tokens == got["greedy"], algo


def test_left_padded_batch_rows_equal_their_batch_1_output(model):
    from megatron_specdec.inference.generation import StageRunner, plain_generate, left_pad

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, HF["vocab_size"], (n,), generator=g).tolist() for n in (3, 17, 9)]
    batch = plain_generate(model.base, prompts, 12, HF["vocab_size"])
    for prompt, row in zip(prompts, batch):
        assert row == plain_generate(model.base, [prompt], 12, HF["vocab_size"])[0]
    tokens, lengths = left_pad(prompts, 0)
    runner = StageRunner(model.base, len(prompts), tokens.shape[1], HF["vocab_size"])
    runner.step(tokens, counts=lengths)
    assert runner.lengths.tolist() == [3, 17, 9]  # padding takes no slot of its row
    for keys, values in runner.context.key_value_memory_dict.values():
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()


def test_finished_rows_leave_a_greedy_batch_and_the_rest_keep_their_output(model, monkeypatch):
    from megatron_specdec.inference.generation import StageRunner, plain_generate

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, HF["vocab_size"], (n,), generator=g).tolist()
               for n in (4, 11, 7, 15)]
    full = plain_generate(model.base, prompts, 12, HF["vocab_size"])
    eos = {full[0][2], full[1][5]}  # rows 0 and 1 stop early (others may too)
    expected = [next((row[:k] for k, t in enumerate(row) if t in eos), row) for row in full]
    kept = []
    keep_rows = StageRunner.keep_rows
    monkeypatch.setattr(StageRunner, "keep_rows",
                        lambda self, rows: (kept.append(rows.tolist()), keep_rows(self, rows)))
    assert plain_generate(model.base, prompts, 12, HF["vocab_size"], eos_ids=eos) == expected
    assert kept, "a quarter of the batch finished, yet no row left it"


def test_bad_generation_input_is_named(model):
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate

    with pytest.raises(ValueError, match="prompt 1 of the batch is empty"):
        plain_generate(model.base, [[1, 2], []], 4, HF["vocab_size"])
    with pytest.raises(ValueError, match="at least one prompt"):
        plain_generate(model.base, [], 4, HF["vocab_size"])
    with pytest.raises(ValueError, match="top_p"):
        plain_generate(model.base, [[1]], 4, HF["vocab_size"], temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeGenerator(model, 0)
    with pytest.raises(ValueError, match="draft policy 'eager'"):
        SpeculativeGenerator(model, 2, policy="eager")
    with pytest.raises(ValueError, match="drafter 'medusa' needs a model whose draft module is medusa"):
        SpeculativeGenerator(model, 2, drafter_kind="medusa")


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_grouped_attention_runs_on_a_fused_cuda_kernel(dtype):
    """A decode step's masked grouped attention on a GPU: the folded form runs on the
    memory-efficient kernel (the enable_gqa form would fall back to the math path, copying
    the cache) and equals the math path's result."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_specdec.models.layers.decode_attention import grouped_sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 64, 9, 64, device="cuda", dtype=dtype, generator=g)
    k, v = torch.randn(2, 300, 64, 3, 64, device="cuda", dtype=dtype, generator=g)
    lengths = torch.randint(100, 300, (64,), device="cuda", generator=g)
    mask = (torch.arange(300, device="cuda") < lengths[:, None])[:, None, None]  # may attend
    with sdpa_kernel(SDPBackend.MATH):
        want = grouped_sdpa(q, k, v, mask, False, 0.125, fold=False)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        got = grouped_sdpa(q, k, v, mask, False, 0.125, fold=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_adaptive_threshold_is_the_measured_cost_ratio(monkeypatch):
    from megatron_specdec.inference import draft_policy
    from megatron_specdec.inference.draft_policy import DraftPolicy, StepCosts, draft_chain

    costs = StepCosts()
    monkeypatch.setattr(draft_policy, "COSTS", costs)
    adaptive, fixed = DraftPolicy.named("adaptive", 4), DraftPolicy.named("fixed", 4)
    assert adaptive.current_threshold() == draft_policy.DEFAULT_THRESHOLD  # nothing timed yet
    for rows, seconds in ((1, 0.040), (3, 0.044), (5, 0.048), (40, 9.0)):  # 40: not a verify
        costs.record_base(rows, seconds)
    assert adaptive.current_threshold() == draft_policy.DEFAULT_THRESHOLD  # no draft step yet
    # draft_chain times each draft step into the policy it runs under.
    pick = (lambda logits: (torch.ones(1), lambda: (torch.zeros(1, dtype=torch.long), None)))
    draft_chain(3, adaptive, None, lambda tokens: None, pick)
    assert len(adaptive.draft_cost.times) == 2 and costs.fresh(adaptive.draft_cost) is not None
    timed = DraftPolicy.named("adaptive", 4)
    timed.draft_cost.record(0.006, costs.forwards)
    # base step 40 ms, each verify row 2 ms, a draft step 6 ms: (6 + 2) / 40.
    assert timed.current_threshold() == pytest.approx(0.2)
    assert timed.keeps(torch.tensor([0.25, 0.15])).tolist() == [True, False]
    assert timed.tree_floor == pytest.approx(math.log(0.2))
    timed.draft_cost.record(0.030, costs.forwards)  # slower once: the fastest recent counts
    assert timed.current_threshold() == pytest.approx(0.2)
    slower = DraftPolicy.named("adaptive", 4)
    slower.draft_cost.record(0.018, costs.forwards)  # (18 + 2) / 40
    assert slower.current_threshold() == pytest.approx(0.5)
    assert fixed.current_threshold() is None and DraftPolicy(4, 0.3).current_threshold() == 0.3
    assert DraftPolicy.named("adaptive", 4).current_threshold() == 0.3  # another drafter's
    slowest = DraftPolicy.named("adaptive", 4)
    slowest.draft_cost.record(10.0, costs.forwards)  # slower than anything: capped
    assert slowest.current_threshold() == draft_policy.THRESHOLD_RANGE[1]


def test_first_use_work_is_counted_once_per_thing(choice_cache):
    """Each piece of one-time work (a kernel choice, a weight's copy, a greedy head's screen)
    counts once, when it is done; asked again, it is not done again."""
    from megatron_specdec.models import first_use
    from megatron_specdec.models.layers.greedy_head import _vector_op, greedy_head
    from megatron_specdec.models.weight_memory import narrow_copy

    linear_kernels, _ = choice_cache
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=g)
    asks = [lambda: narrow_copy(weight), lambda: linear_kernels.product(weight, 1)]
    if _vector_op():  # else no head is built: the logits path runs
        asks.append(lambda: greedy_head(weight, 96, 1))  # after the product it takes
    for ask in asks:
        before = first_use.count()
        ask()
        assert first_use.count() == before + 1
        ask()
        assert first_use.count() == before + 1


def test_a_call_that_did_first_use_work_is_no_cost_sample(model, monkeypatch):
    """A verify forward or a draft step that did one-time work (models/first_use.py) is not
    timed into the policy's costs, the next one of the same kind is: the forward that first
    read a run's panel copies once took 1.3 s against ~18 ms."""
    from megatron_specdec.inference import base_runner, draft_policy
    from megatron_specdec.inference.draft_policy import DraftPolicy, StepCosts, draft_chain
    from megatron_specdec.models import first_use

    costs = StepCosts()
    monkeypatch.setattr(base_runner, "COSTS", costs)
    monkeypatch.setattr(draft_policy, "COSTS", costs)
    runner = base_runner.BaseRunner(model, 1, 64)
    runner.step(torch.randint(0, HF["vocab_size"], (1, 8)), last_only=True)  # the prefill
    step, calls = runner.stage.step, []

    def first_call_copies(*args, **kwargs):  # the first forward does one-time work
        calls.append(1)
        if len(calls) == 1:
            first_use.note()
        return step(*args, **kwargs)

    monkeypatch.setattr(runner.stage, "step", first_call_copies)
    for n in range(2):
        runner.step(torch.randint(0, HF["vocab_size"], (1, 3)))
        assert costs.forwards == n and len(costs.base.get(3, draft_policy.RecentCost()).times) == n
    policy = DraftPolicy.named("adaptive", 4)
    advanced = []

    def advance(tokens):  # the first draft step does one-time work
        advanced.append(1)
        if len(advanced) == 1:
            first_use.note()

    pick = (lambda logits: (torch.ones(1), lambda: (torch.zeros(1, dtype=torch.long), None)))
    draft_chain(3, policy, None, advance, pick)
    assert len(advanced) == 2 and len(policy.draft_cost.times) == 1


def test_a_burst_of_other_work_does_not_stop_drafting_for_good(monkeypatch):
    """A verify width timed during a burst of other work raises the measured threshold, and
    the policy then stops verifying that wide: that timing is forgotten after max_age base
    forwards without a new one, and the threshold is the configured one again (which drafts,
    and so measures the width afresh, from its new timings only). A burst over a width timed
    before never counts."""
    from megatron_specdec.inference import draft_policy
    from megatron_specdec.inference.draft_policy import DraftPolicy, StepCosts

    costs = StepCosts(window=4, max_age=10)
    monkeypatch.setattr(draft_policy, "COSTS", costs)
    policy = DraftPolicy.named("adaptive", 4)

    def plain_steps(n):  # plain steps only, the draft still asked (its cost renewed)
        for _ in range(n):
            costs.record_base(1, 0.040)
            policy.draft_cost.record(0.004, costs.forwards)

    for _ in range(3):
        costs.record_base(1, 0.040)
    costs.record_base(3, 0.044)
    policy.draft_cost.record(0.004, costs.forwards)
    assert policy.current_threshold() == pytest.approx((4 + 2) / 40)
    costs.record_base(3, 0.120)  # a burst over a timed width: its fastest recent counts
    assert policy.current_threshold() == pytest.approx((4 + 2) / 40)
    costs.record_base(5, 0.100)  # a width first timed in a burst
    assert policy.current_threshold() > 0.5
    plain_steps(10)
    assert policy.current_threshold() == draft_policy.DEFAULT_THRESHOLD
    costs.record_base(3, 0.044)  # a verify timed again, in quiet
    assert policy.current_threshold() == pytest.approx((4 + 2) / 40)
    plain_steps(10)
    costs.record_base(3, 0.052)  # timed again after being forgotten: the new timing alone
    assert policy.current_threshold() == pytest.approx((4 + 6) / 40)

"""Speculative generation over a batch with ragged acceptance (small seeded random Llama):
4 prompts of different lengths, each row's output equal to its batch-1 plain greedy output
token for token, for the EAGLE3, Medusa, n-gram and draft-model drafters, fixed and
adaptive, chains and trees (one tree per row), at TP=1, TP=2 and PP=2; an oracle drafter
wrong at different places in each row makes the rows accept different counts in the same
round (exact counts per row), through the EAGLE3 and Medusa drafters, chains and trees. A
row that meets its end-of-turn id leaves the batch (later rounds compute fewer rows) while
the others go on; a seed reproduces a
sampled batch (chains and trees); an empty prompt and an empty batch are refused by name."""

import pytest
import torch

from megatron_specdec import distributed
from test_draft_model_generation import KEEP, save_draft
from megatron_specdec.inference.oracle import OracleDrafter
from test_speculative_generation import CHAINS_ONLY, HF, build, expected_accepts
from workers import is_writer

K, NEW = 4, 12
WRONG_AT = [(5, 6), (1,), (), (2, 3, 9)]  # per row: emitted positions the oracle gets wrong
THRESHOLD = 0.02  # around the random drafts' top probabilities: adaptive chains vary
_g = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(0, HF["vocab_size"], (n,), generator=_g).tolist() for n in (20, 3, 13, 7)]
DRAFTERS = {"eagle3": ("eagle3", "ngram", "draft_model"), "peagle": ("eagle3",),
            "medusa": ("medusa",)}
TREE = (3, 8)  # TreeSpec(top_k, max_nodes) of the random-draft trees; oracle trees: top-2


def policies(kind):
    from megatron_specdec.inference.draft_policy import DraftPolicy

    # n-gram confidence is its running acceptance rate: the default threshold fits it.
    return {"fixed": DraftPolicy(K, None),
            "adaptive": DraftPolicy(K) if kind == "ngram" else DraftPolicy(K, THRESHOLD)}


def batch_worker(tp, pp, draft_dir, out_file):
    """Batch-1 plain greedy per prompt, and the batch through every drafter and policy."""
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.tree import TreeSpec
    from megatron_specdec.inference.generation import plain_generate

    distributed.initialize(tp, pp)
    save_draft(draft_dir, KEEP)  # at this layout; the drafter reads it whole
    results = {}
    for algo, kinds in DRAFTERS.items():
        model = build(algo)
        # K + 1 further tokens: the oracle's drafts in the last round are right too.
        results[algo] = [plain_generate(model.base, [p], NEW + K + 1, HF["vocab_size"])[0]
                         for p in PROMPTS]
        for kind in kinds:
            generator = SpeculativeGenerator(
                model, K, drafter_kind=kind,
                draft_model=draft_dir if kind == "draft_model" else None)
            for name, policy in policies(kind).items():
                generator.policy = policy
                results[f"{algo}/{kind}/{name}"] = generator.generate_batch(PROMPTS, NEW)
        if algo not in CHAINS_ONLY:
            results[f"{algo}/tree"] = SpeculativeGenerator(
                model, K, tree=TreeSpec(*TREE), policy="fixed").generate_batch(PROMPTS, NEW)
        for name, tree in (("oracle", None), ("oracle_tree", TreeSpec(2)))[
                :1 if algo in CHAINS_ONLY else 2]:
            generator = SpeculativeGenerator(model, K, policy="fixed", tree=tree)
            if generator.drafter is not None:  # the last stage
                generator.drafter = OracleDrafter(generator.drafter, results[algo], WRONG_AT,
                                                  HF["vocab_size"])
            results[f"{algo}/{name}"] = generator.generate_batch(PROMPTS, NEW)
    if is_writer():
        torch.save(results, out_file)


# TP 2: test_speculative_generation's chains check that layout by default.
@pytest.mark.parametrize("tp,pp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])
def test_batch_rows_equal_their_batch_1_greedy(tp, pp, tmp_path):
    out = tmp_path / "out.pt"
    distributed.spawn(batch_worker, tp * pp, tp, pp, str(tmp_path / "draft"), str(out))
    results = torch.load(out, weights_only=False)
    for algo, kinds in DRAFTERS.items():
        for kind in kinds:
            for name in ("fixed", "adaptive"):
                rows = results[f"{algo}/{kind}/{name}"]
                for row, greedy in zip(rows, results[algo]):
                    assert row.tokens == greedy[:NEW], (algo, kind, name)
            if kind != "ngram":
                assert {d for r in results[f"{algo}/{kind}/fixed"] for d in r.drafted} == {K}
                adaptive = results[f"{algo}/{kind}/adaptive"]
                assert len({d for r in adaptive for d in r.drafted}) > 1, kind
        for row, greedy in zip(results.get(f"{algo}/tree", ()), results[algo]):
            assert row.tokens == greedy[:NEW], (algo, "tree")
        for name in ("oracle", "oracle_tree")[:1 if algo in CHAINS_ONLY else 2]:
            for row, greedy, wrong in zip(results[f"{algo}/{name}"], results[algo], WRONG_AT):
                assert row.tokens == greedy[:NEW], (algo, name)
                assert row.accepted == expected_accepts(K, NEW, wrong), (algo, name)
    draft_model = results["eagle3/draft_model/fixed"]  # a real draft: ragged acceptance too
    assert len({tuple(r.accepted) for r in draft_model}) > 1


@pytest.fixture(scope="module")
def eagle3():
    distributed.initialize(1, 1)
    return build("eagle3")


@pytest.mark.parametrize("kind,tree", [("eagle3", False), ("ngram", False), ("eagle3", True)])
def test_a_finished_row_leaves_the_batch(eagle3, kind, tree):
    """Outputs unchanged, and each round computes exactly the rows still unfinished."""
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.tree import TreeSpec
    from megatron_specdec.inference.generation import plain_generate

    greedy = [plain_generate(eagle3.base, [p], NEW, HF["vocab_size"])[0] for p in PROMPTS]
    eos = greedy[1][4]  # row 1 ends after 4 tokens (others may meet it too)
    rows = SpeculativeGenerator(eagle3, K, drafter_kind=kind,
                                tree=TreeSpec(*TREE) if tree else None).generate_batch(
        PROMPTS, NEW, eos_ids=[eos])
    for row, full in zip(rows, greedy):
        assert row.tokens == full[: full.index(eos) if eos in full else NEW]
    assert rows[1].tokens == greedy[1][:4]
    longest = max(rows, key=lambda r: len(r.tokens))
    assert len(rows[1].accepted) < len(longest.accepted)  # no rounds counted after its end
    computed = rows[0].batch_rows
    assert computed == [sum(len(r.accepted) > j for r in rows) for j in range(len(computed))]
    assert computed[0] == len(PROMPTS) and computed[-1] < len(PROMPTS)


@pytest.mark.parametrize("one_hot,tree", [(False, False), (True, False), (False, True),
                                          (True, True)])
def test_same_seed_reproduces_a_sampled_batch(eagle3, one_hot, tree):
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling
    from megatron_specdec.inference.tree import TreeSpec

    generator = SpeculativeGenerator(eagle3, K, policy="fixed",
                                     tree=TreeSpec(*TREE) if tree else None)
    runs = [[r.tokens for r in generator.generate_batch(
        PROMPTS, NEW, sampling=Sampling(0.9, seed=seed, one_hot_drafts=one_hot))]
        for seed in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert [len(r) for r in runs[0]] == [NEW] * len(PROMPTS)


def test_bad_batches_are_named(eagle3):
    from megatron_specdec.inference.generator import SpeculativeGenerator

    generator = SpeculativeGenerator(eagle3, K)
    with pytest.raises(ValueError, match="prompt 2 of the batch is empty"):
        generator.generate_batch([[1, 2], [3], []], 4)
    with pytest.raises(ValueError, match="at least one prompt"):
        generator.generate_batch([], 4)

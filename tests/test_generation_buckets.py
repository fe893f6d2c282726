"""Prompt batches padded to a bucket (generation.left_pad; small seeded random Llama): the
padded length is the longest prompt rounded up to the bucket, the prefill runs at that
length, and greedy outputs are token-identical with and without the padding, plain and
speculative (EAGLE3 chain and tree, n-gram), batch 1 and a ragged batch of 3. A bucket below
1 is refused by name."""

import pytest
import torch

from megatron_specdec import distributed
from test_speculative_generation import HF, build

NEW = 10
_g = torch.Generator().manual_seed(42)
PROMPTS = [torch.randint(1, HF["vocab_size"], (n,), generator=_g).tolist() for n in (5, 19, 33)]


@pytest.fixture(scope="module")
def model():
    distributed.initialize(1, 1)
    return build("eagle3")


def test_padded_length_is_the_bucket_multiple():
    from megatron_specdec.inference.generation import left_pad

    for bucket, length in ((1, 33), (16, 48), (32, 64), (33, 33), (64, 64)):
        tokens, lengths = left_pad(PROMPTS, 0, bucket=bucket)
        assert tokens.shape == (3, length), bucket
        assert lengths.tolist() == [5, 19, 33]
        for row, prompt in zip(tokens, PROMPTS):
            assert row[length - len(prompt):].tolist() == prompt
            assert not row[:length - len(prompt)].any()
    with pytest.raises(ValueError, match="prompt_bucket"):
        left_pad(PROMPTS, 0, bucket=0)


def prefill_widths(monkeypatch):
    """The width of every StageRunner.step's tokens, in call order."""
    from megatron_specdec.inference.generation import StageRunner

    widths, step = [], StageRunner.step
    monkeypatch.setattr(StageRunner, "step",
                        lambda self, tokens, *a, **kw: (widths.append(tokens.shape[1]),
                                                        step(self, tokens, *a, **kw))[1])
    return widths


@pytest.mark.parametrize("prompts", [PROMPTS[1:2], PROMPTS], ids=["batch1", "batch3"])
def test_plain_output_is_the_same_padded_or_not(model, prompts, monkeypatch):
    from megatron_specdec.inference.generation import plain_generate

    widths = prefill_widths(monkeypatch)
    exact = plain_generate(model.base, prompts, NEW, HF["vocab_size"], prompt_bucket=1)
    longest = max(len(p) for p in prompts)
    assert widths[0] == longest
    del widths[:]
    padded = plain_generate(model.base, prompts, NEW, HF["vocab_size"], prompt_bucket=16)
    assert widths[0] == -(-longest // 16) * 16 > longest
    assert padded == exact
    assert all(len(row) == NEW for row in exact)  # no row stopped: every token compared


@pytest.mark.parametrize("prompts", [PROMPTS[1:2], PROMPTS], ids=["batch1", "batch3"])
@pytest.mark.parametrize("kind", ["chain", "tree", "ngram"])
def test_speculative_output_is_the_same_padded_or_not(model, prompts, kind, monkeypatch):
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.tree import TreeSpec

    greedy = plain_generate(model.base, prompts, NEW, HF["vocab_size"], prompt_bucket=1)
    widths = prefill_widths(monkeypatch)
    outputs = {}
    for bucket in (1, 16):
        del widths[:]
        generator = SpeculativeGenerator(
            model, 4, policy="fixed", prompt_bucket=bucket,
            tree=TreeSpec(3, 8) if kind == "tree" else None,
            drafter_kind="ngram" if kind == "ngram" else None)
        outputs[bucket] = [r.tokens for r in generator.generate_batch(prompts, NEW)]
        assert widths[0] == -(-max(len(p) for p in prompts) // bucket) * bucket
    assert outputs[16] == outputs[1] == greedy

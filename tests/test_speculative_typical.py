"""Medusa typical acceptance, the explicitly lossy option (small seeded random Llama): at a
temperature near 0 it is greedy verification (output = plain greedy, exact accepted counts of
an oracle chain with planned mistakes, and the random heads' own chains); with eps = 0 it keeps
every draft, wrong ones too (lossy, and eps reaches the op); bad eps/alpha and the settings it
does not apply to are refused by name."""

import pytest

from megatron_specdec import distributed
from megatron_specdec.inference.oracle import OracleDrafter
from test_speculative_generation import HF, K, NEW, PROMPT, WRONG_AT, build, expected_accepts


@pytest.fixture(scope="module")
def medusa():
    distributed.initialize(1, 1)
    return build("medusa")


def _oracle(medusa, greedy, typical):
    from megatron_specdec.inference.generator import SpeculativeGenerator

    generator = SpeculativeGenerator(medusa, K, policy="fixed", typical=typical)
    generator.drafter = OracleDrafter(generator.drafter, [greedy], [WRONG_AT], HF["vocab_size"])
    return generator


def test_typical_acceptance_near_temperature_0_is_greedy(medusa):
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling, TypicalAcceptance
    from megatron_specdec.inference.generation import plain_generate

    greedy = plain_generate(medusa.base, [PROMPT], NEW + K + 1, HF["vocab_size"])[0]
    cold = Sampling(1e-3, seed=0)
    result = _oracle(medusa, greedy, TypicalAcceptance()).generate(PROMPT, NEW, sampling=cold)
    assert result.tokens == greedy[:NEW]
    assert result.accepted == expected_accepts(K, NEW, WRONG_AT)
    own = SpeculativeGenerator(medusa, K, typical=TypicalAcceptance())
    assert own.generate(PROMPT, NEW, sampling=cold).tokens == greedy[:NEW]
    # eps = 0: the threshold is 0, so every draft is kept, the oracle's wrong ones too.
    loose = _oracle(medusa, greedy, TypicalAcceptance(eps=0.0)).generate(
        PROMPT, NEW, sampling=Sampling(1.0, seed=0))
    assert loose.accepted == [K] * len(loose.accepted) and loose.tokens != greedy[:NEW]


@pytest.mark.parametrize("settings,name", [(dict(eps=-0.1), "eps"), (dict(eps=1.5), "eps"),
                                           (dict(alpha=float("nan")), "alpha"),
                                           (dict(alpha=-1.0), "alpha")])
def test_bad_typical_settings_are_named(settings, name):
    from megatron_specdec.inference.sampling import TypicalAcceptance

    with pytest.raises(ValueError, match=f"typical acceptance {name} must"):
        TypicalAcceptance(**settings)


def test_typical_is_refused_where_it_does_not_apply(medusa):
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling, TypicalAcceptance
    from megatron_specdec.inference.tree import TreeSpec

    typical = TypicalAcceptance()
    with pytest.raises(ValueError, match="drafter 'ngram' verifies by rejection"):
        SpeculativeGenerator(medusa, K, drafter_kind="ngram", typical=typical)
    with pytest.raises(ValueError, match="verifies chains"):
        SpeculativeGenerator(medusa, K, tree=TreeSpec(2), typical=typical)
    generator = SpeculativeGenerator(medusa, K, typical=typical)
    for sampling in (None, Sampling(0.7, top_k=5), Sampling(0.7, top_p=0.9)):
        with pytest.raises(ValueError, match="temperature > 0 and no top_k/top_p"):
            generator.generate(PROMPT, 4, sampling=sampling)

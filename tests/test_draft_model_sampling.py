"""Lossless speculative sampling with a draft model: drafts sampled from the draft GPT's own
distribution and verified with it give tokens distributed as plain sampling's (the
chi-square of test_speculative_sampling.py, fewer runs), and both verdicts occur."""

import torch

from megatron_specdec import distributed
from test_draft_model_generation import KEEP, draft_model
from test_speculative_generation import HF, PROMPT, build
from test_speculative_sampling import SETTINGS, _same_distribution

NEW, RUNS, K = 2, 100, 2


def test_draft_model_sampling_matches_plain_sampling():
    from megatron_specdec.methods.draft_model.proposer import DraftModelDrafter
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.sampling import Sampling
    from megatron_specdec.inference.generation import plain_generate

    distributed.initialize(1, 1)
    model = build("eagle3")
    draft, _ = draft_model(KEEP)
    vocab = HF["vocab_size"]
    generator = SpeculativeGenerator(model, K, policy="fixed", drafter_kind="draft_model",
                                     drafter=DraftModelDrafter(draft, vocab))
    plain, spec, accepted = [], [], []
    for seed in range(RUNS):
        rng = torch.Generator().manual_seed(seed)
        plain.append(plain_generate(model.base, [PROMPT], NEW, vocab, generator=rng,
                                    **SETTINGS)[0])
        result = generator.generate(PROMPT, NEW, sampling=Sampling(**SETTINGS, seed=seed))
        spec.append(result.tokens)
        accepted.extend(result.accepted)
    assert _same_distribution(torch.tensor(plain), torch.tensor(spec)) > 1e-3
    assert 0 < sum(accepted) < K * len(accepted), accepted

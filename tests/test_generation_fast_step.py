"""The greedy chain without the general step (inference/generation.py, GreedyChain) gives
what StageRunner.step gives, bitwise: the ids, the captured states a drafter reads, the cache
it leaves, for one-token steps and verify chains; it takes a width only after a forward of
that width ran the layers as one op, and a full cache refuses it as the general step does."""

import pytest
import torch

from megatron_specdec import distributed
from tests.test_decode_layer import base_model, hf_config, set_path

WIDTHS = (1, 1, 4, 1, 3, 4, 1, 1, 3)


def forwards(base, fast_steps: bool):
    """Ids, captured states and cache lengths of a prefill and greedy forwards of WIDTHS
    tokens (each chain's last two positions rewound, as a verify rejects drafts), of a runner
    capturing layer 0's output and the final norm's; whether each ran as GreedyChain."""
    from megatron_specdec.inference.generation import _GREEDY_CHAIN, StageRunner

    runner = StageRunner(base, 1, 40, 512, capture_ids=[0], capture_final=True)
    runner.fast_steps = fast_steps
    g = torch.Generator().manual_seed(3)
    runner.step(torch.randint(0, 512, (1, 9), generator=g), greedy=True)
    seen, fast = [], []
    for s in WIDTHS:
        chain = runner.context.memo.get(_GREEDY_CHAIN)
        fast.append(chain is not None and s in chain.widths)
        ids = runner.step(torch.randint(0, 512, (1, s), generator=g), greedy=True)
        seen.append((ids.clone(), {k: v.clone() for k, v in runner.captured.items()},
                     int(runner.lengths[0])))
        if s > 2:
            runner.rewind(2)
    caches = [t.clone() for kv in runner.context.key_value_memory_dict.values() for t in kv]
    return seen, fast, caches, runner


def test_the_greedy_chain_equals_the_general_step_bitwise():
    from megatron_specdec.models.layers.greedy_head import greedy_head

    distributed.initialize(1, 1)
    base = base_model(hf_config("llama"))
    set_path(base, True, True)
    if greedy_head(base.output_layer.weight, 512, 1) is None:
        pytest.skip("this CPU has no vector path of the screened greedy head, which the "
                    "greedy chain needs")
    fast, used, fast_caches, runner = forwards(base, fast_steps=True)
    general, unused, general_caches, _ = forwards(base, fast_steps=False)
    # Each width's first forward takes the general step, the later ones the chain.
    assert used == [False, True, False, True, False, True, True, True, True]
    assert not any(unused)
    for (a_ids, a_states, a_len), (b_ids, b_states, b_len) in zip(fast, general):
        assert torch.equal(a_ids, b_ids) and a_len == b_len
        assert a_states.keys() == b_states.keys() == {0, "final"}
        for key in a_states:
            assert torch.equal(a_states[key], b_states[key]), key
    assert all(torch.equal(a, b) for a, b in zip(fast_caches, general_caches))

    # A full cache refuses the chain as it refuses the general step.
    runner.context.lengths.fill_(runner.context.max_sequence_length - 2)
    with pytest.raises(ValueError, match="cannot take 42"):
        runner.step(torch.zeros(1, 4, dtype=torch.long), greedy=True)


def test_the_greedy_chain_stays_out_of_what_it_does_not_compute():
    """Logits (sampling), the last position of a chain only, and layers that do not run as
    one op keep the general step."""
    from megatron_specdec.inference.generation import _GREEDY_CHAIN, StageRunner

    distributed.initialize(1, 1)
    base = base_model(hf_config("llama"))
    set_path(base, True, True, whole=False)
    runner = StageRunner(base, 1, 24, 512)
    runner.step(torch.zeros(1, 4, dtype=torch.long), greedy=True)
    runner.step(torch.zeros(1, 1, dtype=torch.long), greedy=True)
    assert _GREEDY_CHAIN not in runner.context.memo  # the layers ran one by one
    set_path(base, True, True)
    runner = StageRunner(base, 1, 24, 512)
    runner.step(torch.zeros(1, 4, dtype=torch.long))
    logits = runner.step(torch.zeros(1, 1, dtype=torch.long))
    assert logits.shape == (1, 1, 512) and _GREEDY_CHAIN not in runner.context.memo
    runner.step(torch.zeros(1, 3, dtype=torch.long), greedy=True, last_only=True)
    assert _GREEDY_CHAIN not in runner.context.memo

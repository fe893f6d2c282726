"""Speculative greedy generation of SmolLM2-135M-Instruct equals its plain greedy generation
at TP=1, TP=2 (padded query groups) and PP=2 (EAGLE3 embedding replica, aux states sent
from the first stage), with a random EAGLE3 draft, a random Medusa draft, and oracle drafts
that accept several tokens per round and roll back at planned places."""

import pytest
import torch

from megatron_specdec import distributed
from megatron_specdec.inference.oracle import OracleDrafter
from test_speculative_generation import expected_accepts
from workers import is_writer

K, NEW = 4, 24
WRONG_AT = (3, 4, 11)


def worker(tp, pp, hf_dir, prompt, out_file, tree=None, oracle_tree=None):
    """Plain greedy, then per algorithm a random draft and an oracle drafter;
    `tree`/`oracle_tree` are the TreeSpecs of the two speculative runs (None: chain)."""
    from megatron_specdec import convert
    from megatron_specdec.inference.generator import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.loading.hf_conversion import model_from_hf

    distributed.initialize(tp, pp)
    base, config = model_from_hf(hf_dir)
    base.eval()
    greedy = plain_generate(base, [prompt], NEW + K + 1, config.vocab_size)[0]
    results = {"greedy": greedy[:NEW]}
    for algo, cfg in (("eagle3", {"ttt_steps": K}), ("medusa", {"medusa_num_heads": K})):
        model = convert(base, algo, cfg, hf_config=config).eval()
        results[algo] = SpeculativeGenerator(model, tree=tree).generate(prompt, NEW)
        generator = SpeculativeGenerator(model, tree=oracle_tree)
        if generator.drafter is not None:  # the last stage
            generator.drafter = OracleDrafter(generator.drafter, [greedy], [WRONG_AT],
                                              config.vocab_size)
        results[f"{algo}_oracle"] = generator.generate(prompt, NEW)
    if is_writer():
        torch.save(results, out_file)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_smollm2_speculative_equals_greedy(tp, pp, default_hf_dir, chat_prompt_ids, tmp_path):
    out = tmp_path / "out.pt"
    distributed.spawn(worker, tp * pp, tp, pp, str(default_hf_dir), chat_prompt_ids, str(out))
    got = torch.load(out, weights_only=False)
    for algo in ("eagle3", "medusa"):
        assert got[algo].tokens == got["greedy"], algo
        assert got[f"{algo}_oracle"].tokens == got["greedy"], algo
        assert got[f"{algo}_oracle"].accepted == expected_accepts(K, NEW, WRONG_AT), algo

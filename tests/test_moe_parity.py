"""Tiny random Qwen3-MoE and Mixtral models, built with transformers from configs, match their
Megatron twins (megatron-core MoELayer: top-k router, all-gather dispatcher, SequentialMLP
experts) at TP=1, TP=2 (expert TP 2), EP=2 and PP=2, logits within fp32 tolerance and greedy
tokens equal. Flipping the router's top-k normalisation breaks the match."""

import pytest
import torch

import moe_models
import workers
from megatron_specdec import distributed

FAMILIES = ("qwen3_moe", "mixtral")
PROMPT = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1)).tolist()
NEW_TOKENS = 6
TOL = 1e-4  # fp32: TP=1 measured ~3e-7; a wrong expert or routing weight moves logits by ~1e-1


@pytest.fixture(scope="module")
def hf_models(module_tmp):
    root = module_tmp("hf")
    models = {}
    for family in FAMILIES:
        model = moe_models.save_random(family, root / family)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0]
            tokens = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=0)[0, len(PROMPT):].tolist()
        models[family] = (root / family, logits, tokens)
    # The Qwen3-MoE weights with norm_topk_prob flipped: Megatron then routes unnormalised.
    flipped = moe_models.with_config_field(root / "qwen3_moe", root / "flipped",
                                           norm_topk_prob=False)
    return models, flipped


def _run(tmp_path, tp, pp, ep, dirs):
    out = tmp_path / "out.pt"
    distributed.spawn(workers.moe_parity, max(tp * pp, ep * tp * pp), tp, pp, ep,
                      [str(d) for d in dirs], PROMPT, NEW_TOKENS, str(out))
    return torch.load(out)


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1)],
                         ids=["tp1", "tp2", "ep2", "pp2"])
def test_moe_logits_match_hf(hf_models, tp, pp, ep, tmp_path):
    models, flipped = hf_models
    dirs = [models[f][0] for f in FAMILIES] + ([flipped] if (tp, pp, ep) == (1, 1, 1) else [])
    results = _run(tmp_path, tp, pp, ep, dirs)
    for family in FAMILIES:
        hf_dir, ref_logits, ref_tokens = models[family]
        got = results[str(hf_dir)]
        err = (got["logits"] - ref_logits).abs().max().item()
        assert err <= TOL, (family, err)
        assert got["tokens"] == ref_tokens, family
    if str(flipped) in results:  # the negative control: the same check fails (6.3e-3 measured)
        err = (results[str(flipped)]["logits"] - models["qwen3_moe"][1]).abs().max().item()
        assert err > 10 * TOL, err

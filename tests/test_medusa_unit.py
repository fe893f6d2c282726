"""Medusa in one process: heads start as the base model (identity blocks, copied lm_head),
head i at position t is scored on token t+2+i with its weight, the HF table names the
FasterDecoding layout, and training moves only the heads."""

import pytest
import torch
import torch.nn.functional as F


def _tiny(config):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_specdec.models.speculative import convert
    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model

    hf = LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=500,
                     max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = build_model(hf)  # vocabulary padded to 512: ids 500.. must never win
    load_hf_into_model(base, hf, LlamaForCausalLM(hf).state_dict())
    return convert(base, "medusa", config, hf_config=hf), hf


def test_heads_start_as_the_base_model(one_process):
    model, hf = _tiny({"medusa_num_heads": 2})
    ids = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, base_logits = model.base_head(model.run_base(ids).residual)
        heads = model.draft(hidden)
    for logits in heads:
        assert torch.allclose(logits[..., :500], base_logits[..., :500], atol=1e-6)
        assert torch.isinf(logits[..., 500:]).all()


def test_head_i_scores_token_t_plus_2_plus_i(one_process):
    model, hf = _tiny({"medusa_num_heads": 3, "medusa_head_weights": [1.0, 0.5, 0.25]})
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    b, s = 2, 10
    ids = torch.randint(0, 500, (b, s), generator=g)
    loss_mask = (torch.rand(b, s, generator=g) > 0.3).float()
    out = model(ids, loss_mask)
    with torch.no_grad():
        hidden, _ = model.base_head(model.run_base(ids).residual)
        heads = model.draft(hidden)
    total = 0.0
    for i, logits in enumerate(heads):
        shift = 2 + i
        ce = F.cross_entropy(logits[: s - shift, :, :500].reshape(-1, 500),
                             ids[:, shift:].t().reshape(-1), reduction="none")
        mask = loss_mask[:, shift:].t().reshape(-1)
        want = (ce * mask).sum()
        assert torch.allclose(out["step_loss"][i], want, atol=1e-4)
        assert out["step_count"][i] == mask.sum()
        total += [1.0, 0.5, 0.25][i] * want
    assert torch.allclose(out["loss_sum"], total, atol=1e-4)
    assert out["num_tokens"] == loss_mask[:, 2:].sum()


def test_hf_table_uses_the_fastdecoding_layout(one_process):
    from megatron_specdec.checkpointing import hf_mapping as mapping
    from megatron_specdec.methods.medusa import hf_weights as medusa

    model, hf = _tiny({"medusa_num_heads": 2, "medusa_num_layers": 2})
    cfg = model.spec_config
    geo = mapping.Geometry(4, 2, 16, 500, 512, 2)
    state = {k: v for k, v in model.draft.state_dict().items() if not k.endswith("_extra_state")}
    hf_state = mapping.megatron_to_hf(medusa.rules(cfg), state, geo, cfg.medusa_num_heads)
    assert sorted(hf_state) == sorted(
        [f"{i}.{j}.linear.{t}" for i in range(2) for j in range(2) for t in ("weight", "bias")]
        + ["0.2.weight", "1.2.weight"])
    assert hf_state["1.2.weight"].shape == (500, 64)
    back = mapping.hf_to_megatron(medusa.rules(cfg), hf_state, geo, cfg.medusa_num_heads)
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("algo,config", [
    ("medusa", {"medusa_num_heads": 2}),
    ("eagle3", {"draft_vocab_size": 500, "ttt_steps": 2}),
])
def test_training_moves_only_the_draft(one_process, algo, config):
    from megatron_specdec.models.speculative import convert
    from megatron_specdec.training.schedule import forward_backward

    model, hf = _tiny({"medusa_num_heads": 1})
    model = convert(model.base, algo, config, hf_config=hf)
    base_before = {k: v.clone() for k, v in model.base.state_dict().items() if torch.is_tensor(v)}
    draft_before = {k: v.clone() for k, v in model.draft.named_parameters()}
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2)
    assert {id(p) for p in model.trainable_parameters()} == {id(p) for p in model.draft.parameters()}
    batch = {"input_ids": torch.randint(0, 500, (2, 12)), "loss_mask": torch.ones(2, 12)}
    forward_backward(model, [batch])
    assert all(p.grad is None for p in model.base.parameters())
    optimizer.step()
    assert all(torch.equal(v, base_before[k]) for k, v in model.base.state_dict().items()
               if torch.is_tensor(v))
    changed = [k for k, v in model.draft.named_parameters() if not torch.equal(v, draft_before[k])]
    assert len(changed) == len(draft_before)

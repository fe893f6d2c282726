"""A bf16 training checkpoint saved while some draft parameters were fp32 (a draft GPT's norm
weights before model_provider gave norms the model dtype; the EAGLE3 draft's still are) holds
no fp32 master for them: the parameter was its own. Resuming with those parameters in bf16
reads the stored fp32 weight into the new master, exactly."""

import torch


HF = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, vocab_size=300, max_position_embeddings=64,
          tie_word_embeddings=False)


def test_fp32_parameters_saved_without_masters_resume_exactly(one_process, tmp_path):
    from transformers import LlamaConfig

    from megatron_specdec import registry
    from megatron_specdec.loading.hf_conversion import base_meta
    from megatron_specdec.models.provider import build_model
    from megatron_specdec.models.speculative import convert
    from megatron_specdec.training import base_fingerprint, checkpoints
    from megatron_specdec.training.optimizer import DraftOptimizer
    from megatron_specdec.training.recipe import OptimizerConfig

    config = LlamaConfig(**HF)
    torch.manual_seed(0)
    base = build_model(config, dtype=torch.bfloat16, transformer_impl="local")
    model = convert(base, "eagle3", {"ttt_steps": 2}, hf_config=config)
    norms = {n: p for n, p in model.draft.named_parameters() if "norm" in n}
    assert norms and all(p.dtype == torch.float32 for p in norms.values())
    with torch.no_grad():  # values no bf16 can hold
        for p in norms.values():
            p.copy_(1 + torch.rand_like(p) * 1e-3)
    saved = {n: p.detach().clone() for n, p in norms.items()}
    cfg = OptimizerConfig()
    fingerprint = base_fingerprint.fingerprint(model.base, config.to_dict(), "bfloat16")
    meta = dict(base_meta(config, base, torch.bfloat16, "local"),
                training_checkpoint={"draft": registry.config_to_dict(model.spec_config),
                                     "base_model": "tiny", "base": fingerprint})
    path = checkpoints.save(tmp_path, 1, model, DraftOptimizer(
        model.trainable_parameters(), cfg, torch.bfloat16), checkpoints.TrainerState(step=1),
        meta, keep_last=1)

    for p in norms.values():  # as the draft is built now: norms in the model dtype
        p.data = torch.zeros_like(p, dtype=torch.bfloat16)
    params = list(model.trainable_parameters())
    opt = DraftOptimizer(params, cfg, torch.bfloat16)
    state = checkpoints.load(path, model, opt, fingerprint)
    assert state.step == 1
    masters = {id(p): m for p, m in zip(params, opt.main)}
    for name, p in norms.items():
        assert masters[id(p)] is not p and masters[id(p)].dtype == torch.float32
        assert torch.equal(masters[id(p)], saved[name]), name  # the stored fp32 weight, exactly
        assert torch.equal(p, saved[name].bfloat16()), name

"""Tiny random mixture-of-experts models built with transformers from configs (no download):
Qwen3-MoE (renormalised top-k, q/k norm) and Mixtral, 4 experts, top-2, every layer MoE."""

import json

import torch

COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, num_experts_per_tok=2)


def config(family: str, **overrides):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        return Qwen3MoeConfig(**{**COMMON, **dict(
            head_dim=32, intermediate_size=128, moe_intermediate_size=48, num_experts=4,
            norm_topk_prob=True, use_sliding_window=False), **overrides})
    return MixtralConfig(**{**COMMON, **dict(
        intermediate_size=48, num_local_experts=4, sliding_window=None), **overrides})


def save_random(family: str, path, seed: int = 0, **overrides):
    """A random model saved to `path`; norms and routers perturbed so they count (HF
    initialises norms to one, and a near-uniform router would hide its top-k semantics)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model.eval()


def with_config_field(src, dst, **fields):
    """A copy of the HF directory `src` whose config.json has `fields` changed (weights linked)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst

"""One small randomly initialised model per other supported family, built with transformers
from a config, matches its Megatron twin at TP=1 and TP=2: Mistral, Qwen2 (q/k/v bias),
Qwen3 (q/k norm), and Llama with Llama-3.1 RoPE scaling."""

import pytest
import torch

from megatron_specdec import distributed
import workers

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "mistral": MistralConfig(sliding_window=None, **COMMON),
        "qwen2": Qwen2Config(use_sliding_window=False, **COMMON),
        "qwen3": Qwen3Config(head_dim=32, use_sliding_window=False, **COMMON),
        "llama31": LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192},
                               **COMMON),
    }


def _save_random_model(name, path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _configs()[name]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF zero-initialises biases: make them count
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(1.0 if "norm" in n else 0.0, 0.2)
    model.save_pretrained(path)
    return model


# TP 2 by default for Qwen2 (Llama's split plus QKV biases) and Qwen3 (plus q/k norms); Mistral
# and Llama-3.1 split exactly as Llama does, so their TP 2 runs are slow.
FAMILY_LAYOUTS = [(family, 1) for family in ("mistral", "qwen2", "qwen3", "llama31")] + [
    ("qwen2", 2), ("qwen3", 2), pytest.param("mistral", 2, marks=pytest.mark.slow),
    pytest.param("llama31", 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,tp", FAMILY_LAYOUTS)
def test_random_family_model_matches_hf(family, tp, tmp_path):
    hf_dir = tmp_path / "hf"
    model = _save_random_model(family, hf_dir)
    if family == "qwen2":
        assert any(n.endswith("q_proj.bias") for n, _ in model.named_parameters())
    if family == "llama31":
        from megatron_specdec.models.families import rope_settings

        assert rope_settings(model.config)["rope_scaling"] is True
    if family == "qwen3":
        assert any("q_norm" in n for n, _ in model.named_parameters())
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    out = tmp_path / "out.pt"
    distributed.spawn(workers.parity, tp, tp, 1, str(hf_dir), prompt, 8, str(out))
    got = torch.load(out)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
        ref_tokens = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                    do_sample=False, pad_token_id=0)[0, 40:].tolist()
    assert (got["logits"] - ref).abs().max().item() <= 1e-3
    assert got["tokens"] == ref_tokens

"""Norm weights follow the model dtype: a bf16 GPTModel built by model_provider has bf16 norm
weights, so torch's rms_norm runs fused without its dtype-mismatch warning; an fp32 model's
stay fp32."""

import warnings

import pytest
import torch


HF = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, vocab_size=300, max_position_embeddings=64,
          tie_word_embeddings=False)
MISMATCH = "Mismatch dtype between input and weight"


@pytest.fixture
def warn_always():
    """torch warns once per process; make every occurrence visible to the test."""
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(False)


def _model(dtype):
    from transformers import LlamaConfig

    from megatron_specdec.models.provider import build_model

    torch.manual_seed(0)
    return build_model(LlamaConfig(**HF), dtype=dtype, transformer_impl="local").eval()


def _norms(model) -> dict:
    return {n: p.dtype for n, p in model.named_parameters() if "layernorm" in n}


def _mismatch_warnings(run) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if MISMATCH in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_weights_follow_the_model_dtype(one_process, warn_always, dtype):
    model = _model(dtype)
    norms = _norms(model)
    assert len(norms) == 5 and set(norms.values()) == {dtype}, norms  # 2 per layer + final
    ids = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        assert _mismatch_warnings(lambda: model(ids, torch.arange(4)[None], None)) == []
    # The check sees the warning when there is one (an fp32 weight under a bf16 input).
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert _mismatch_warnings(lambda: torch.rms_norm(x, (64,), torch.ones(64), 1e-5))

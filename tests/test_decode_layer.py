"""The decoding layer (models/layers/decode_layer.py) gives bitwise the logits of megatron's
TransformerLayer forward: for Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k norm) bases, at TP=1
and TP=2, over a ragged prefill, a chain verify and one-token steps of a batch of two. An MoE
layer keeps megatron's forward."""

import pytest
import torch

from megatron_specdec import distributed

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False)


def hf_config(family):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {"llama": LlamaConfig(**COMMON),
            "qwen2": Qwen2Config(use_sliding_window=False, **COMMON),
            "qwen3": Qwen3Config(head_dim=32, use_sliding_window=False, **COMMON)}[family]


def base_model(hf):
    """This rank's random base; biases and norms perturbed so that they count."""
    from transformers import AutoModelForCausalLM

    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    base = build_model(hf)
    load_hf_into_model(base, hf, reference.state_dict())
    return base.eval()


def logits(base, lean: bool):
    """Logits of a ragged two-row prefill, a 5-token chain and three one-token steps, with
    the decoding layer's path (`lean`) or megatron's forward."""
    from megatron_specdec.inference.generation import StageRunner, left_pad

    for layer in base.decoder.layers:
        layer.__dict__["lean"] = lean  # the cached property, decided here instead
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (11, 7)]
    tokens, counts = left_pad(prompts, 0, bucket=4)
    runner = StageRunner(base, 2, 40, 512)
    out = [runner.step(tokens, counts=counts)]
    out.append(runner.step(torch.randint(0, 512, (2, 5), generator=g)))
    out += [runner.step(torch.randint(0, 512, (2, 1), generator=g)) for _ in range(3)]
    return torch.cat(out, dim=1)


def compare_worker(tp, pp, family, out):
    distributed.initialize(tp, pp)
    hf = hf_config(family)
    base = base_model(hf)
    lean = [layer.lean for layer in base.decoder.layers]
    got = {"lean": lean, "decode": logits(base, True), "forward": logits(base, False)}
    if torch.distributed.get_rank() == 0:
        torch.save(got, out)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_decoding_layer_equals_megatron_forward_bitwise(family):
    distributed.initialize(1, 1)
    hf = hf_config(family)
    base = base_model(hf)
    if family == "qwen2":
        assert base.decoder.layers[0].self_attention.linear_qkv.bias is not None
    if family == "qwen3":
        assert base.decoder.layers[0].self_attention.q_layernorm is not None
    assert all(layer.lean for layer in base.decoder.layers)
    decode, forward = logits(base, True), logits(base, False)
    assert torch.equal(decode, forward), (decode - forward).abs().max()


def test_decoding_layer_equals_megatron_forward_at_tp2(tmp_path):
    out = tmp_path / "out.pt"
    distributed.spawn(compare_worker, 2, 2, 1, "qwen2", str(out))
    got = torch.load(out)
    assert all(got["lean"])
    assert torch.equal(got["decode"], got["forward"]), \
        (got["decode"] - got["forward"]).abs().max()


def test_moe_layer_keeps_megatron_forward():
    from megatron_specdec.models.provider import build_model
    from moe_models import config

    distributed.initialize(1, 1)
    base = build_model(config("qwen3_moe")).eval()
    assert not any(layer.lean for layer in base.decoder.layers)
    logits(base, False)  # and decodes through it


def test_a_prefill_wider_than_the_small_row_products_equals_megatron_forward():
    """Past MAX_ROWS rows the decoding layer's linears take the modules' own forward."""
    from megatron_specdec.inference.generation import StageRunner
    from megatron_specdec.models.layers.linear_kernels import MAX_ROWS

    distributed.initialize(1, 1)
    base = base_model(hf_config("llama"))
    tokens = torch.randint(0, 512, (1, MAX_ROWS + 20), generator=torch.Generator().manual_seed(2))
    out = {}
    for lean in (True, False):
        for layer in base.decoder.layers:
            layer.__dict__["lean"] = lean
        out[lean] = StageRunner(base, 1, MAX_ROWS + 20, 512).step(tokens)
    assert torch.equal(out[True], out[False]), (out[True] - out[False]).abs().max()

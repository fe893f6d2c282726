"""HF -> Megatron (TP=2 dist checkpoint) -> HF gives every tensor bitwise equal and an
equivalent config; the exported directory loads with transformers."""

import json

import torch

from checkpoint_tools import hf_to_megatron, megatron_to_hf
from megatron_specdec.loading.hf_conversion import read_hf_state

IGNORED_CONFIG_KEYS = {"transformers_version", "architectures", "_name_or_path", "dtype",
                       "torch_dtype"}


def _config(path):
    cfg = json.loads((path / "config.json").read_text())
    return {k: v for k, v in cfg.items() if k not in IGNORED_CONFIG_KEYS}


def test_hf_megatron_hf_round_trip_is_bitwise(default_hf_dir, tmp_path):
    ckpt, back = tmp_path / "ckpt", tmp_path / "hf"
    hf_to_megatron.main(["--model", str(default_hf_dir), "--out", str(ckpt), "--tp", "2"])
    megatron_to_hf.main(["--model", str(ckpt), "--out", str(back)])
    src, dst = read_hf_state(default_hf_dir), read_hf_state(back)
    assert set(src) == set(dst)
    for name in src:
        assert src[name].dtype == dst[name].dtype, name
        assert torch.equal(src[name], dst[name]), name
    assert _config(back) == _config(default_hf_dir)
    assert json.loads((back / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(back)
    assert model.config.tie_word_embeddings
    AutoTokenizer.from_pretrained(back)

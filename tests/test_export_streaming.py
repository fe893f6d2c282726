"""Streaming Megatron -> HF export of the base: one checkpoint tensor alive at a time (the
earlier export read a whole layer per read), files sharded under a size limit with an index
transformers follows, and the same tensors as the one-file export."""

import json

import pytest
import torch
from checkpoint_reads import LiveLoads
from safetensors.torch import load_file

from megatron_specdec import distributed
from megatron_specdec.loading import hf_conversion
from megatron_specdec.checkpointing import hf_files as files

HF = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, vocab_size=500, max_position_embeddings=64,
          tie_word_embeddings=False)


@pytest.fixture(scope="module")
def ckpt(module_tmp):
    """A small random Llama imported in this process (draft exports from TP=2 and PP=2
    checkpoints: test_export_eagle3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    root = module_tmp("export")
    LlamaForCausalLM(LlamaConfig(**HF)).save_pretrained(root / "hf")
    distributed.initialize(1, 1)
    try:
        return hf_conversion.hf_to_megatron(root / "hf", root / "ckpt")
    finally:
        distributed.destroy()  # leave no process group behind for other test modules


def test_export_holds_one_checkpoint_tensor_at_a_time(ckpt, tmp_path, monkeypatch):
    loads = LiveLoads(monkeypatch)
    out = hf_conversion.megatron_to_hf(ckpt, tmp_path / "hf")
    stored = len(files.CheckpointTensors(ckpt))
    assert loads.loaded == stored  # every tensor read once, each in a read of its own
    assert loads.peak == 1 and loads.live == 0
    src, dst = load_file(str(ckpt.parent / "hf" / files.HF_WEIGHTS)), load_file(
        str(out / files.HF_WEIGHTS))
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)


def test_sharded_export_loads_in_transformers(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    single = hf_conversion.megatron_to_hf(ckpt, tmp_path / "one", index=True)
    limit_mb = 0.1
    sharded = hf_conversion.megatron_to_hf(ckpt, tmp_path / "sharded", max_shard_mb=limit_mb)
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2 and not (sharded / files.HF_WEIGHTS).exists()
    merged = {}
    for f in shards:
        tensors = load_file(str(f))
        payload = sum(t.numel() * t.element_size() for t in tensors.values())
        assert payload <= limit_mb * 2**20 or len(tensors) == 1, (f.name, payload)
        merged.update(tensors)
    index = json.loads((sharded / files.HF_INDEX).read_text())
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    one_index = json.loads((single / files.HF_INDEX).read_text())
    assert set(one_index["weight_map"].values()) == {files.HF_WEIGHTS}
    assert index["metadata"] == one_index["metadata"]
    reference = load_file(str(single / files.HF_WEIGHTS))
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k]) for k in reference)
    a = AutoModelForCausalLM.from_pretrained(single)
    b = AutoModelForCausalLM.from_pretrained(sharded)
    ids = torch.tensor([[1, 7, 42, 3]])
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_write_sharded_refuses_a_stream_longer_than_its_header(tmp_path):
    specs = [("a", (2,), torch.float32)]
    with pytest.raises(ValueError, match="tensor 'b' is not in the header"):
        files.write_sharded(tmp_path, specs, iter([("a", torch.zeros(2)), ("b", torch.zeros(2))]))

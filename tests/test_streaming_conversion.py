"""Streaming HF <-> Megatron conversion: import holds about one source tensor at a time,
each TP rank reads only its slices of them, and it writes the same checkpoint (at TP=1 and
TP=2) as merging the whole HF state in memory; export reads one layer per read and writes a
safetensors file transformers loads, bitwise equal to the source."""

import weakref
from collections.abc import Mapping

import pytest
import torch

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec.loading import hf_conversion
from megatron_specdec.checkpointing import hf_files as files, hf_mapping as mapping

HF = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, vocab_size=500, max_position_embeddings=64,
          tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_dir(module_tmp):
    """A small random Llama saved sharded (several files and an index), in bfloat16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF)).to(torch.bfloat16)
    out = module_tmp("hf") / "llama"
    model.save_pretrained(out, max_shard_size="60KB")
    assert (out / files.HF_INDEX).is_file()
    return out


class LiveTensors(Mapping):
    """HF tensors (files.HFTensors) that count how many of those handed out are alive at once,
    and the elements read of each."""

    def __init__(self, source):
        self.source, self.live, self.peak, self.elements = source, 0, 0, {}

    def _released(self):
        self.live -= 1

    def __getitem__(self, name):
        return self.read(name)

    def read(self, name, dim=None, start=0, stop=None):
        tensor = self.source.read(name, dim, start, stop)
        self.live += 1
        self.peak = max(self.peak, self.live)
        self.elements[name] = self.elements.get(name, 0) + tensor.numel()
        weakref.finalize(tensor, self._released)
        return tensor

    def shape(self, name):
        return self.source.shape(name)

    def __contains__(self, name):
        return name in self.source

    def __iter__(self):
        return iter(self.source)

    def __len__(self):
        return len(self.source)


def test_import_holds_one_merge_of_source_tensors_at_a_time(one_process, hf_dir):
    from megatron_specdec.models.provider import build_model

    config = hf_conversion.read_hf_config(hf_dir)
    source = LiveTensors(files.HFTensors(hf_dir, torch.float32))
    model = build_model(config)
    hf_conversion.load_hf_into_model(model, config, source)
    assert source.peak == 3  # q, k and v of one layer, merged into linear_qkv
    assert source.live == 0


@pytest.mark.parametrize("tp,padded_groups,padded_vocab", [(2, 2, 512), (4, 4, 1024)])
def test_each_rank_reads_only_its_slices(hf_dir, tp, padded_groups, padded_vocab):
    """Per-rank reads give exactly the rank's slice of the merged tensor (TP=4: two ranks hold
    only padding groups, one only padding vocabulary rows), and the ranks together read every
    element of a split tensor once."""
    config = hf_conversion.read_hf_config(hf_dir)
    rules = hf_conversion.weight_rules(config)
    geo = mapping.Geometry.from_hf(config, {"vocab_size": padded_vocab,
                                            "query_groups": padded_groups})
    index = mapping.rule_index(rules, config.num_hidden_layers)
    hf = files.HFTensors(hf_dir)
    merged = mapping.MergedTensors(rules, hf, geo, config.num_hidden_layers)
    split = {n for name in merged for n in merged._sources[name][1]
             if index[name].tp_dim is not None}
    read = {n: 0 for n in split}
    for rank in range(tp):
        source = LiveTensors(hf)
        per_rank = mapping.MergedTensors(rules, source, geo, config.num_hidden_layers)
        for name in merged:
            want = mapping.shard(index[name], merged[name], rank, tp)
            assert torch.equal(per_rank.shard(name, rank, tp), want), (name, rank)
        for n in split:
            read[n] += source.elements[n]
    assert read == {n: hf[n].numel() for n in split}


@pytest.mark.parametrize("tp", [1, 2])
def test_streamed_import_writes_what_the_in_memory_merge_gives(one_process, hf_dir, tmp_path, tp):
    ckpt = hf_conversion.hf_to_megatron(hf_dir, tmp_path / "ckpt", tp=tp, dtype="bfloat16")
    config = hf_conversion.read_hf_config(hf_dir)
    meta = checkpoint.read_meta(ckpt)
    reference = mapping.hf_to_megatron(
        hf_conversion.weight_rules(config), hf_conversion.read_hf_state(hf_dir),
        mapping.Geometry.from_hf(config, meta["padding"]), config.num_hidden_layers)
    saved = files.CheckpointTensors(ckpt)
    loaded = saved.load(list(reference))
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():  # norms too take the model dtype (model_provider)
        assert loaded[name].dtype == torch.bfloat16, name
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name
    # One layer per read: the slice of the stacked tensor, nothing else.
    stacked = checkpoint.load_plain_tensors(ckpt)["decoder.layers.mlp.linear_fc1.weight"]
    one = saved.load(["decoder.layers.1.mlp.linear_fc1.weight"])
    assert list(one) == ["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(one["decoder.layers.1.mlp.linear_fc1.weight"], stacked[1])


def test_streamed_export_is_bitwise_and_loads_in_transformers(one_process, hf_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ckpt = hf_conversion.hf_to_megatron(hf_dir, tmp_path / "ckpt", dtype="bfloat16")
    back = hf_conversion.megatron_to_hf(ckpt, tmp_path / "back")
    src, dst = hf_conversion.read_hf_state(hf_dir), hf_conversion.read_hf_state(back)
    assert set(src) == set(dst)
    for name in src:  # tensors keep the checkpoint's dtype (bf16, norms included)
        assert dst[name].dtype == torch.bfloat16, name
        assert torch.equal(src[name], dst[name]), name
    with safe_open(str(back / files.HF_WEIGHTS), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    model = AutoModelForCausalLM.from_pretrained(back)
    assert torch.equal(model.lm_head.weight, src["lm_head.weight"])


def test_write_safetensors_round_trips_every_dtype(tmp_path):
    from safetensors.torch import load_file

    tensors = {"w": torch.randn(3, 5).to(torch.bfloat16), "h": torch.randn(4).half(),
               "f": torch.randn(2, 2, 2)[:, 0],  # not contiguous
               "d2t": torch.arange(7), "t2d": torch.rand(9) > 0.5, "scalar": torch.tensor(2.5)}
    specs = [(k, v.shape, v.dtype) for k, v in tensors.items()]
    files.write_safetensors(tmp_path / "a.safetensors", specs, iter(tensors.items()),
                            metadata={"format": "pt"})
    back = load_file(str(tmp_path / "a.safetensors"))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_write_safetensors_names_a_tensor_that_differs_from_the_header(tmp_path):
    specs = [("a", (2, 3), torch.float32), ("b", (4,), torch.float32)]
    with pytest.raises(ValueError, match=r"tensor 'b' \(5,\).*header's 'b' \(4,\)"):
        files.write_safetensors(tmp_path / "x.safetensors", specs,
                                iter([("a", torch.zeros(2, 3)), ("b", torch.zeros(5))]))
    with pytest.raises(ValueError, match="1 tensors written, the header lists 2"):
        files.write_safetensors(tmp_path / "y.safetensors", specs,
                                iter([("a", torch.zeros(2, 3))]))

"""DFlash export -> import round-trips bitwise (TP=1 export, TP=2 import and re-export, so
the padded query group is dropped and re-added), and a bad export is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_specdec import distributed
from test_dflash_parallel import build, random_hf_draft, tiny_hf_config


def _export_worker(out_dir):
    from megatron_specdec.methods.dflash import hf_weights
    from megatron_specdec.models.weight_memory import place_weights

    distributed.initialize(1, 1)
    model = build(random_hf_draft())
    place_weights(model)  # as a generation in the same process leaves them
    hf_weights.export_model(model, tiny_hf_config(), out_dir)


def _reimport_worker(tp, in_dir, out_dir):
    from megatron_specdec.methods.dflash import hf_weights

    distributed.initialize(tp, 1)
    model = build()
    hf_weights.import_into(model, in_dir)
    hf_weights.export_model(model, tiny_hf_config(), out_dir)


@pytest.fixture(scope="module")
def exported(module_tmp):
    out = module_tmp("export") / "draft"
    distributed.spawn(_export_worker, 1, str(out))
    return out


def _files(d):
    from megatron_specdec.methods.dflash import hf_weights

    return hf_weights.read_export(d)


def test_export_layout(exported):
    from megatron_specdec.methods.dflash.hf_weights import MASK_EMBEDDING_FILE

    config, state = _files(exported)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 499, "target_layer_ids": [0, 1, 2]}
    assert config["num_key_value_heads"] == 3  # unpadded
    assert "layers.1.self_attn.k_norm.weight" in state and "embed_tokens.weight" not in state
    assert not any(k.startswith("model.") for k in load_file(str(exported / "model.safetensors")))
    # The mask embedding alone, not the buffer of placed weights it was a view of.
    assert (exported / MASK_EMBEDDING_FILE).stat().st_size < state["mask_embedding"].nbytes + 4096


def test_roundtrip_bitwise_through_tp2(exported, tmp_path):
    again = tmp_path / "again"
    distributed.spawn(_reimport_worker, 2, 2, str(exported), str(again))
    (c1, s1), (c2, s2) = _files(exported), _files(again)
    assert c1 == c2 and set(s1) == set(s2)
    for name, t in s1.items():
        assert t.dtype == s2[name].dtype and torch.equal(t, s2[name]), name
    assert (exported / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


def test_bad_export_refused_by_name(exported, tmp_path):
    from safetensors.torch import save_file

    from megatron_specdec.checkpointing.hf_mapping import WeightMappingError
    from megatron_specdec.methods.dflash import hf_weights

    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("config.json", "mask_embedding.pt"):
        (bad / name).write_bytes((exported / name).read_bytes())
    state = load_file(str(exported / "model.safetensors"))
    state.pop("layers.0.self_attn.q_norm.weight")
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(WeightMappingError, match="layers.0.self_attn.q_norm.weight"):
        hf_weights.read_export(bad)
    config = json.loads((exported / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures"):
        hf_weights.read_export(bad)


@pytest.mark.slow  # four conversions in fresh processes: ~80 s on the loaded 2-core machine
def test_checkpoint_export_import_roundtrip(tmp_path):
    """The registry's hooks: a speculative checkpoint (TP=1) -> export -> import at TP=2 ->
    export again: the same files bitwise (checkpoint_tools/export_draft and import_draft go
    through these hooks)."""
    import train_support as ts
    from megatron_specdec import registry
    from megatron_specdec.loading.conversion import convert_checkpoint
    from megatron_specdec.loading.hf_conversion import hf_to_megatron

    method = registry.get("dflash")
    hf_dir = ts.make_tiny_model(tmp_path / "hf")
    hf_to_megatron(hf_dir, tmp_path / "base")
    convert_checkpoint(tmp_path / "base", tmp_path / "spec", "dflash",
                       {"block_size": 4, "target_layer_ids": [0, 1, 2]})
    first = method.export_hf(tmp_path / "spec", tmp_path / "first")
    cfg = method.import_hf(first, tmp_path / "base", tmp_path / "imported", tp=2)
    assert cfg.block_size == 4 and cfg.target_layer_ids == [0, 1, 2]
    again = method.export_hf(tmp_path / "imported", tmp_path / "again")
    for name in ("config.json", "model.safetensors"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert torch.equal(_files(first)[1]["mask_embedding"], _files(again)[1]["mask_embedding"])

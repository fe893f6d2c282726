"""Import of HF EAGLE3 drafts into Megatron speculative checkpoints: import(export(x)) == x
bitwise at TP=1, TP=2 and PP=2 (every tensor of the checkpoint, base included), and drafts that do
not fit the target, miss tensors or disagree with themselves are refused by name, with
nothing written."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec import distributed
from test_export_eagle3 import make_checkpoints, tiny_hf_config


@pytest.fixture(scope="module")
def ckpts(module_tmp):
    root = module_tmp("spec")
    distributed.spawn(make_checkpoints, 2, str(root), ["eagle3", "eagle3_2layers", "peagle"],
                      [("tp2", 2, 1), ("tp1", 1, 1)])
    return root


@pytest.fixture(scope="module")
def draft_dir(ckpts, module_tmp):
    from megatron_specdec.methods.eagle3.hf_export import export_eagle3

    return export_eagle3(ckpts / "eagle3_tp1", module_tmp("hf") / "eagle3")


def _same_checkpoint(a, b):
    x, y = checkpoint.load_plain_tensors(a), checkpoint.load_plain_tensors(b)
    x = {k: v for k, v in x.items() if torch.is_tensor(v)}
    y = {k: v for k, v in y.items() if torch.is_tensor(v)}
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    return len(x)


@pytest.mark.parametrize("name,tp,pp", [("eagle3", 1, 1), ("eagle3_2layers", 2, 1),
                                         ("eagle3", 1, 2), ("peagle", 1, 2)])
def test_import_of_export_is_the_checkpoint(ckpts, tmp_path, name, tp, pp):
    from megatron_specdec.methods.eagle3.hf_import import import_eagle3
    from megatron_specdec.methods.eagle3.hf_export import export_eagle3

    src = ckpts / f"{name}_tp{tp}"
    hf = export_eagle3(src, tmp_path / "hf")
    # onto the base-only checkpoint (saved at TP=2): the base comes from there, resharded
    out = tmp_path / "imported"
    cfg = import_eagle3(hf, ckpts / "base", out, tp=tp, pp=pp)
    assert cfg.eagle_num_layers == (2 if "2layers" in name else 1)
    assert cfg.parallel_drafting == (name == "peagle") and cfg.ttt_steps == (5 if name == "peagle" else 7)
    meta = checkpoint.read_meta(out)
    assert (meta["saved_tensor_parallel"], meta["saved_pipeline_parallel"]) == (tp, pp)
    assert _same_checkpoint(src, out) > 10


def _copy_draft(draft_dir, dst, config_edit=None, drop=()):
    dst.mkdir()
    config = json.loads((draft_dir / "config.json").read_text())
    config.update(config_edit or {})
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(draft_dir / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in drop}, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("edit,drop,message", [
    ({"hidden_size": 128}, (), "draft hidden_size=128 does not match the target model's 96"),
    ({"target_hidden_size": 128}, (), "draft target_hidden_size=128 does not match"),
    ({"vocab_size": 32000}, (), "draft vocab_size=32000 does not match the target model's 500"),
    ({"rope_theta": 10000.0}, (), "rope_theta=10000.0 does not match the target model's 5000.0"),
    ({}, ("midlayer.mlp.down_proj.weight",), "tensor 'midlayer.mlp.down_proj.weight' is missing"),
    ({"draft_vocab_size": 256}, (), "tensor 'lm_head.weight'"),
    ({"architectures": ["LlamaForCausalLM"]}, (), "not an EAGLE3 draft"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}, (), "name different layers"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0}}, (),
     "draft rope_scaling={'rope_type': 'yarn', 'factor': 32.0} does not match"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, (), "does not match the target"),
], ids=["hidden", "target_hidden", "vocab", "rope", "missing_tensor", "draft_vocab",
        "architecture", "aux_ids", "rope_yarn", "rope_linear"])
def test_bad_drafts_are_refused_and_nothing_is_written(ckpts, draft_dir, tmp_path, capsys,
                                                       edit, drop, message):
    from checkpoint_tools import import_draft
    from megatron_specdec.cli.common import run_cli

    bad = _copy_draft(draft_dir, tmp_path / "bad", edit, drop)
    out = tmp_path / "out"
    code = run_cli(lambda: import_draft.main(
        ["--draft", str(bad), "--model", str(ckpts / "base"), "--out", str(out)]))
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_modelopt_layout_imports_as_the_same_checkpoint(ckpts, draft_dir, tmp_path):
    """ModelOpt 0.47 exports a one-layer draft as layers.0.* with d2t alone (t2d is derived);
    it imports to the same checkpoint as the midlayer.* layout, and a d2t pointing outside
    the vocabulary is refused."""
    from megatron_specdec.methods.eagle3.hf_import import DraftMismatchError, import_eagle3

    modelopt = tmp_path / "modelopt"
    modelopt.mkdir()
    (modelopt / "config.json").write_text((draft_dir / "config.json").read_text())
    tensors = load_file(str(draft_dir / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items() if k != "t2d"}
    assert any(k.startswith("layers.0.") for k in renamed)
    save_file(renamed, str(modelopt / "model.safetensors"))
    import_eagle3(draft_dir, ckpts / "base", tmp_path / "a")
    import_eagle3(modelopt, ckpts / "base", tmp_path / "b")
    assert _same_checkpoint(tmp_path / "a", tmp_path / "b") > 10

    renamed["d2t"] = renamed["d2t"].clone()
    renamed["d2t"][-1] = 10**6
    save_file(renamed, str(modelopt / "model.safetensors"))
    with pytest.raises(DraftMismatchError, match="d2t maps outside the vocabulary"):
        import_eagle3(modelopt, ckpts / "base", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_vllm_only_aux_ids_are_converted(draft_dir, ckpts, tmp_path):
    """A draft that names its aux layers only in vLLM's convention imports with the same
    output-of-layer ids."""
    from megatron_specdec.methods.eagle3 import hf_import as draft_import

    config = json.loads((draft_dir / "config.json").read_text())
    del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert draft_import._aux_layer_ids(config) == [0, 2, 3]


def test_d2t_t2d_disagreement_is_refused(draft_dir, ckpts, tmp_path):
    from megatron_specdec.methods.eagle3.hf_import import DraftMismatchError, import_eagle3

    bad = _copy_draft(draft_dir, tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["t2d"] = tensors["t2d"].roll(1)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(DraftMismatchError, match="d2t and t2d disagree"):
        import_eagle3(bad, ckpts / "base", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_published_style_draft(draft_dir):
    """EAGLE/SpecForge-style drafts: a shipped embed_tokens.weight is ignored (the draft shares
    the base's), no aux ids in the config means the default for the base, and without d2t/t2d
    a full-vocabulary draft gets the identity mapping."""
    from megatron_specdec.methods.eagle3 import hf_import as draft_import

    config, tensors = draft_import.read_hf_draft(draft_dir)
    del config["eagle_config"], config["eagle_aux_hidden_state_layer_ids"]
    config["draft_vocab_size"] = 500
    tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    tensors["lm_head.weight"] = torch.zeros(500, 96)
    tensors["embed_tokens.weight"] = torch.zeros(500, 96)
    base = tiny_hf_config()
    draft_import.check_fits(config, base)
    cfg = draft_import.draft_config(config, tensors, base)
    assert cfg.aux_layer_ids == [1, 1, 0] and cfg.draft_vocab_size == 500
    kept = draft_import.check_tensors(config, cfg, tensors, draft_dir)
    assert "embed_tokens.weight" not in kept
    assert torch.equal(kept["d2t"], torch.zeros(500, dtype=torch.int64)) and bool(kept["t2d"].all())


def test_chain_draft_imports_as_the_start_of_a_parallel_drafting_one(ckpts, draft_dir, tmp_path):
    """--parallel-drafting: the chain draft's weights unchanged, mask_hidden started from the
    base's aux states, the mask token the base's last id; its export says parallel_drafting
    as vLLM reads it; a pipeline-parallel import is refused by name (the base runs whole)."""
    from megatron_specdec.methods.eagle3.hf_export import export_eagle3
    from megatron_specdec.methods.eagle3.hf_import import import_eagle3, read_hf_draft

    sequences = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                 for n in (12, 20)]
    with pytest.raises(ValueError, match="import at --pp 1"):
        import_eagle3(draft_dir, ckpts / "base", tmp_path / "pp2", pp=2,
                      parallel_drafting=sequences)
    assert not (tmp_path / "pp2").exists()
    cfg = import_eagle3(draft_dir, ckpts / "base", tmp_path / "ckpt", parallel_drafting=sequences)
    assert cfg.parallel_drafting and cfg.mask_token_id == 499
    _, chain = read_hf_draft(draft_dir)
    config, tensors = read_hf_draft(export_eagle3(tmp_path / "ckpt", tmp_path / "hf"))
    assert config["parallel_drafting"] is True and config["mask_token_id"] == 499
    assert sorted(tensors) == sorted([*chain, "mask_hidden"])
    assert tensors["mask_hidden"].shape == (1, 3 * 96) and tensors["mask_hidden"].std() > 0
    for name, t in chain.items():
        assert torch.equal(tensors[name], t), name
    with pytest.raises(ValueError, match="already drafts in parallel"):
        import_eagle3(tmp_path / "hf", ckpts / "base", tmp_path / "again",
                      parallel_drafting=sequences)


def test_parallel_drafting_import_can_add_identity_layers(ckpts, draft_dir, tmp_path):
    """--draft-layers 2: the chain draft's layer becomes layers.0 unchanged, and the added
    layer's attention and MLP outputs start at zero (the draft drafts as the chain draft);
    fewer layers than the draft has, or the flag without --parallel-drafting, are refused."""
    from megatron_specdec.methods.eagle3.hf_export import export_eagle3
    from megatron_specdec.methods.eagle3.hf_import import (
        import_eagle3,
        read_hf_draft,
        start_parallel_drafting,
    )

    sequences = [list(range(3, 15))]
    cfg = import_eagle3(draft_dir, ckpts / "base", tmp_path / "ckpt",
                        parallel_drafting=sequences, draft_layers=2)
    assert cfg.eagle_num_layers == 2 and cfg.parallel_drafting
    _, chain = read_hf_draft(draft_dir)
    config, tensors = read_hf_draft(export_eagle3(tmp_path / "ckpt", tmp_path / "hf"))
    assert config["num_hidden_layers"] == 2
    for name, t in chain.items():
        moved = "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name
        assert torch.equal(tensors[moved], t), name
    assert not tensors["layers.1.self_attn.o_proj.weight"].any()
    assert not tensors["layers.1.mlp.down_proj.weight"].any()
    assert tensors["layers.1.self_attn.q_proj.weight"].std() > 0
    with pytest.raises(ValueError, match="layers can be added, not removed"):
        start_parallel_drafting(dict(config, parallel_drafting=False), tensors,
                                tiny_hf_config(), layers=1)
    with pytest.raises(ValueError, match="read only with --parallel-drafting"):
        import_eagle3(draft_dir, ckpts / "base", tmp_path / "y", draft_layers=2)

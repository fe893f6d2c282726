"""HF export of draft modules from tiny speculative checkpoints saved at TP=2, PP=2 and TP=1
(the same weights): bitwise identical files from every layout, padded query groups and padded
vocabulary rows dropped, the FasterDecoding Medusa layout, the names and shapes vLLM, SGLang
and TensorRT-LLM load, and bad input refused with nothing written.

The base has 3 query groups (padded to 4 at TP=2) and a 500-token vocabulary (padded to 512);
the EAGLE3 draft vocabulary is 300 ids (padded to 384) with a non-identity d2t.
"""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_specdec import distributed

DRAFTS = {
    "eagle3": ("eagle3", {"draft_vocab_size": 300, "eagle_aux_hidden_state_layer_ids": [0, 2, 3]}),
    "eagle3_2layers": ("eagle3", {"draft_vocab_size": 300, "eagle_num_layers": 2}),
    "peagle": ("eagle3", {"draft_vocab_size": 300, "parallel_drafting": True, "ttt_steps": 5}),
    "medusa": ("medusa", {"medusa_num_heads": 2, "medusa_num_layers": 2}),
}
LAYOUTS = [("tp2", 2, 1), ("pp2", 1, 2), ("tp1", 1, 1)]


def tiny_hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=4, hidden_size=96, num_attention_heads=6,
                       num_key_value_heads=3, intermediate_size=128, vocab_size=500,
                       max_position_embeddings=64, tie_word_embeddings=True, rope_theta=5000.0,
                       rms_norm_eps=1e-5)


def _build(name):
    """This rank's speculative model: a seeded base, a seeded draft whose norms and Medusa
    blocks are perturbed (the same values on every TP rank) and, for EAGLE3, a seeded draft
    vocabulary. Padded query groups and padded vocabulary rows hold zeros."""
    from transformers import LlamaForCausalLM

    from megatron_specdec.loading.hf_conversion import load_hf_into_model
    from megatron_specdec.models.provider import build_model
    from megatron_specdec.models.speculative import convert

    hf = tiny_hf_config()
    torch.manual_seed(0)
    base = build_model(hf)
    load_hf_into_model(base, hf, LlamaForCausalLM(hf).state_dict())
    algo, config = DRAFTS[name]
    model = convert(base, algo, config, hf_config=hf)
    if model.draft is not None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for pname, p in model.draft.named_parameters():
                if "norm" in pname or "blocks" in pname:
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
            if algo == "eagle3":
                # Padded draft-vocabulary rows are masked (never trained) and start at zero,
                # which import(export(x)) == x relies on (export drops them).
                lm_head = model.draft.lm_head.weight
                rows = torch.arange(lm_head.shape[0]) + model.draft.vocab_offset
                assert not lm_head[rows >= 300].any()
                targets = torch.randperm(500, generator=g)[:300].sort().values
                t2d = torch.zeros(500, dtype=torch.bool)
                t2d[targets] = True
                model.draft.set_draft_vocab(targets - torch.arange(300), t2d)
    return model


def make_checkpoints(root, names, layouts):
    """Save `names` at the first layout from seeded weights, then load and re-save them at
    each later layout; also a base-only checkpoint `base`."""
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.loading.hf_conversion import base_meta
    from megatron_specdec.loading.speculative import load_speculative, save_speculative

    (first, tp, pp), rest = layouts[0], layouts[1:]
    distributed.initialize(tp, pp)
    for name in names:
        model = _build(name)
        meta = base_meta(tiny_hf_config(), model.base, torch.float32, "local")
        save_speculative(model, f"{root}/{name}_{first}", meta)
    checkpoint.save_checkpoint(model.base, f"{root}/base", meta)
    for layout, tp, pp in rest:
        distributed.initialize(tp, pp)
        for name in names:
            model, _, meta = load_speculative(f"{root}/{name}_{first}")
            save_speculative(model, f"{root}/{name}_{layout}", checkpoint.base_meta_of(meta))


@pytest.fixture(scope="module")
def ckpts(module_tmp):
    root = module_tmp("spec")
    distributed.spawn(make_checkpoints, 2, str(root), list(DRAFTS), LAYOUTS)
    return root


@pytest.fixture(scope="module")
def exported(ckpts, module_tmp):
    from megatron_specdec.methods.eagle3.hf_export import export_eagle3
    from megatron_specdec.methods.medusa.hf_export import export_medusa

    root = module_tmp("hf")
    out = {}
    for name, (algo, _) in DRAFTS.items():
        export = export_medusa if algo == "medusa" else export_eagle3
        for layout, _, _ in LAYOUTS:
            out[name, layout] = export(ckpts / f"{name}_{layout}", root / f"{name}_{layout}")
    return out


def _read(directory):
    weights = next(p for p in directory.iterdir() if p.suffix == ".safetensors")
    return json.loads((directory / "config.json").read_text()), load_file(str(weights))


@pytest.mark.parametrize("name", list(DRAFTS))
def test_every_layout_exports_identical_bytes(exported, name):
    ref = exported[name, "tp2"]
    files = sorted(p.name for p in ref.iterdir())
    assert len(files) == 2, files
    for layout in ("pp2", "tp1"):
        out = exported[name, layout]
        assert sorted(p.name for p in out.iterdir()) == files
        for f in files:
            assert (out / f).read_bytes() == (ref / f).read_bytes(), (name, layout, f)


def test_eagle3_config_and_tensors(exported, ckpts):
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.methods.eagle3.hf_export import tensor_shapes

    config, tensors = _read(exported["eagle3", "tp2"])
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 300 and config["vocab_size"] == 500
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM: entering layer k
    assert config["rope_theta"] == 5000.0 and config["rope_scaling"] is None
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
    assert config["num_key_value_heads"] == 3 and config["num_hidden_layers"] == 1
    assert "target_hidden_size" not in config and config["tie_word_embeddings"] is False
    assert {k: tuple(v.shape) for k, v in tensors.items()} == tensor_shapes(config)
    assert "midlayer.self_attn.q_proj.weight" in tensors and "embed_tokens.weight" not in tensors
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == 300
    assert bool(tensors["t2d"][torch.arange(300) + tensors["d2t"]].all())

    # Against the raw checkpoint: padded vocabulary rows and the padded query group dropped.
    plain = checkpoint.load_plain_tensors(ckpts / "eagle3_tp2")
    lm_head = plain["eagle3.lm_head.weight"]
    assert lm_head.shape == (384, 96) and torch.equal(tensors["lm_head.weight"], lm_head[:300])
    groups = plain["eagle3.layers.0.self_attention.linear_qkv.weight"].reshape(4, 64, 192)
    assert torch.equal(groups[3], torch.zeros_like(groups[3]))  # the padded group
    q, k, v = groups[:3].split([32, 16, 16], dim=1)
    assert torch.equal(tensors["midlayer.self_attn.q_proj.weight"], q.reshape(96, 192))
    assert torch.equal(tensors["midlayer.self_attn.k_proj.weight"], k.reshape(48, 192))
    assert torch.equal(tensors["midlayer.self_attn.v_proj.weight"], v.reshape(48, 192))
    proj = plain["eagle3.layers.0.self_attention.linear_proj.weight"]
    assert proj.shape == (96, 128)
    assert torch.equal(tensors["midlayer.self_attn.o_proj.weight"], proj[:, :96])


def test_multi_layer_draft_uses_layers_i(exported):
    from megatron_specdec.methods.eagle3.hf_export import tensor_shapes

    config, tensors = _read(exported["eagle3_2layers", "tp1"])
    assert config["num_hidden_layers"] == 2
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]  # N=4 default
    assert {k: tuple(v.shape) for k, v in tensors.items()} == tensor_shapes(config)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (96, 192)  # 2h input
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (96, 96)
    assert "layers.1.hidden_norm.weight" not in tensors


def test_medusa_fasterdecoding_layout(exported, ckpts):
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.methods.medusa.hf_export import tensor_shapes

    directory = exported["medusa", "pp2"]
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["config.json", "medusa_lm_head.safetensors"]
    config, tensors = _read(directory)
    assert config["medusa_num_heads"] == 2 and config["medusa_num_layers"] == 2
    assert config["hidden_size"] == 96 and config["vocab_size"] == 500
    assert config["medusa_fc_bias"] is True  # vLLM's Medusa reads it to build biased blocks
    assert {k: tuple(v.shape) for k, v in tensors.items()} == tensor_shapes(config)
    plain = checkpoint.load_plain_tensors(ckpts / "medusa_tp2")
    for i in range(2):
        for j in range(2):
            w = plain[f"medusa.heads.{i}.blocks.{j}.linear.weight"]
            assert torch.equal(tensors[f"{i}.{j}.linear.weight"], w) and w.abs().sum() > 0
        lm_head = plain[f"medusa.heads.{i}.lm_head.weight"]
        assert lm_head.shape == (512, 96) and torch.equal(tensors[f"{i}.2.weight"], lm_head[:500])


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_engine_loaders_accept_the_export(exported, engine):
    """Replays each engine's EAGLE3 loader (export/engine_names.py) on the one-layer export:
    every tensor lands on a parameter of its shape, every parameter is filled."""
    from megatron_specdec.export import engine_names

    config, tensors = _read(exported["eagle3", "tp1"])
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    loader = engine_names.ENGINES[engine]
    assert engine_names.check(loader, config, shapes) == []
    # The replay notices a wrong shape and a missing tensor.
    bad = dict(shapes, **{"fc.weight": (96, 96)})
    del bad["midlayer.hidden_norm.weight"]
    problems = engine_names.check(loader, config, bad)
    assert any("fc.weight" in p and "shape" in p for p in problems), problems
    assert any("hidden_norm.weight is never loaded" in p for p in problems), problems


def _cli(argv, capsys):
    from checkpoint_tools import export_draft
    from megatron_specdec.cli.common import run_cli

    code = run_cli(lambda: export_draft.main([str(a) for a in argv]))
    return code, capsys.readouterr().err


def test_full_export(ckpts, exported, tmp_path, capsys):
    """out/base (transformers loads it; an index names every tensor) beside out/eagle3 (the
    draft-only export's bytes); Medusa goes to out/medusa."""
    from transformers import AutoModelForCausalLM

    from megatron_specdec.export.full_export import export_full

    out = tmp_path / "full"
    code, err = _cli(["--model", ckpts / "eagle3_pp2", "--out", out, "--full"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["base", "eagle3"]
    draft = exported["eagle3", "tp2"] / "model.safetensors"
    assert (out / "eagle3" / "model.safetensors").read_bytes() == draft.read_bytes()
    index = json.loads((out / "base" / "model.safetensors.index.json").read_text())
    weights = load_file(str(out / "base" / "model.safetensors"))
    assert set(index["weight_map"]) == set(weights)
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    size = sum(t.numel() * t.element_size() for t in weights.values())
    assert index["metadata"]["total_size"] == size
    model = AutoModelForCausalLM.from_pretrained(out / "base")
    assert model.config.vocab_size == 500 and model.model.embed_tokens.weight.shape == (500, 96)
    medusa = export_full(ckpts / "medusa_tp1", tmp_path / "medusa_full")
    assert sorted(p.name for p in medusa.iterdir()) == ["base", "medusa"]


@pytest.mark.parametrize("extra", [[], ["--full"]], ids=["draft", "full"])
def test_no_draft_module_is_refused_and_writes_nothing(ckpts, tmp_path, capsys, extra):
    out = tmp_path / "out"
    code, err = _cli(["--model", ckpts / "base", "--out", out] + extra, capsys)
    assert code == 2 and "holds no draft module" in err, err
    assert list(tmp_path.iterdir()) == []


def test_wrong_algorithm_and_overwrite(ckpts, tmp_path, capsys):
    from megatron_specdec.checkpointing.checkpoint import CheckpointError
    from megatron_specdec.methods.medusa.hf_export import export_medusa

    with pytest.raises(CheckpointError, match="holds a eagle3 draft module, not medusa"):
        export_medusa(ckpts / "eagle3_tp1", tmp_path / "m")
    assert not (tmp_path / "m").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep").write_text("x")
    code, err = _cli(["--model", ckpts / "eagle3_tp1", "--out", tmp_path / "busy"], capsys)
    assert code == 2 and "--overwrite" in err and (tmp_path / "busy" / "keep").exists()
    code, err = _cli(["--model", ckpts / "eagle3_tp1", "--out", tmp_path / "busy", "--overwrite",
                      "--dtype", "bfloat16"], capsys)
    assert code == 0, err
    _, tensors = _read(tmp_path / "busy")
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no temporary left behind


def test_unmapped_draft_tensor_is_an_error(ckpts):
    """A draft tensor the weight table has no HF name for (a Qwen2 q/k/v bias, Qwen3 q/k norms)
    stops the export by name instead of being dropped."""
    from megatron_specdec.export import draft_source
    from megatron_specdec.methods.eagle3 import hf_export as eagle3_hf
    from megatron_specdec.checkpointing.hf_mapping import WeightMappingError

    source = draft_source.read_draft(ckpts / "eagle3_tp1", "eagle3")
    extra = {"layers.0.self_attention.linear_qkv.bias": torch.zeros(128)}
    source = dataclasses.replace(source, tensors=dict(source.tensors, **extra))
    with pytest.raises(WeightMappingError, match="linear_qkv.bias have no HF name"):
        eagle3_hf.hf_tensors(source)


def test_help(capsys):
    from checkpoint_tools import export_draft, import_draft

    for tool in (export_draft, import_draft):
        with pytest.raises(SystemExit) as e:
            tool.main(["--help"])
        assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--full" in text and "--overwrite" in text and "--draft" in text


def test_sharded_export_holds_the_same_tensors(ckpts, exported, tmp_path):
    """--max-shard-mb: files under the limit, an index naming every tensor's file, and the
    same tensors as the single-file export (read back as the importer and engines read)."""
    from megatron_specdec.methods.eagle3.hf_import import read_hf_draft
    from megatron_specdec.methods.eagle3.hf_export import export_eagle3

    limit_mb = 0.05
    out = export_eagle3(ckpts / "eagle3_tp1", tmp_path / "sharded", max_shard_mb=limit_mb)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    for f in files:
        tensors = load_file(str(f))
        big = max(t.numel() * t.element_size() for t in tensors.values())
        payload = sum(t.numel() * t.element_size() for t in tensors.values())
        assert payload <= limit_mb * 2**20 or len(tensors) == 1, (f, payload, big)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    config, sharded = read_hf_draft(out)
    single_config, single = _read(exported["eagle3", "tp1"])
    assert config == single_config and sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


@pytest.mark.parametrize("name", ["eagle3_2layers", "medusa"])
def test_draft_export_holds_one_checkpoint_tensor_at_a_time(ckpts, exported, tmp_path,
                                                            monkeypatch, name):
    """Each draft tensor is read on its own and released before the next is read (the earlier
    export read the whole draft in one load), and the files are the same bytes."""
    from checkpoint_reads import LiveLoads

    from megatron_specdec.methods.eagle3.hf_export import export_eagle3
    from megatron_specdec.methods.medusa.hf_export import export_medusa
    from megatron_specdec.checkpointing import hf_files as files

    export = export_medusa if name == "medusa" else export_eagle3
    loads = LiveLoads(monkeypatch)
    out = export(ckpts / f"{name}_tp2", tmp_path / name)
    prefix = DRAFTS[name][0] + "."
    assert loads.loaded == len(files.CheckpointTensors(ckpts / f"{name}_tp2", prefix))
    assert loads.peak == 1 and loads.live == 0
    for f in sorted(p.name for p in exported[name, "tp2"].iterdir()):
        assert (out / f).read_bytes() == (exported[name, "tp2"] / f).read_bytes(), f

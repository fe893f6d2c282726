"""Bad input to every checkpoint_tools script ends in one line on stderr naming the file and
what is wrong (exit 2, no traceback): missing paths, truncated or foreign safetensors, JSON
that does not parse, shard indexes naming absent files, dist checkpoints with a missing,
truncated or corrupt file. The library raises typed errors; run_cli prints them."""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import save_file

from checkpoint_tools import (convert_speculative, export_draft, hf_to_megatron, import_draft,
                              megatron_to_hf, prune_depth, recalibrate_draft_vocab)
from conftest import REPO
from megatron_specdec.cli.common import run_cli

SHIPPED_DRAFT_CONFIG = REPO / "models" / "eagle3_smollm2" / "config.json"
DATA = REPO / "data" / "smollm2_regen.jsonl.gz"


@pytest.fixture(scope="module")
def good(module_tmp):
    """A small HF Llama directory, its Megatron checkpoint, and a small HF EAGLE3 draft
    directory (the shipped draft's config over two shards of made-up tensors)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = module_tmp("bad_input")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "hf")
    assert run_cli(lambda: hf_to_megatron.main(["--model", str(root / "hf"),
                                                "--out", str(root / "ckpt")])) == 0
    draft = root / "draft"
    draft.mkdir()
    shutil.copy(SHIPPED_DRAFT_CONFIG, draft / "config.json")
    shards = {"model-00001-of-00002.safetensors": {"fc.weight": torch.zeros(4, 8)},
              "model-00002-of-00002.safetensors": {"lm_head.weight": torch.zeros(8, 4)}}
    for name, tensors in shards.items():
        save_file(tensors, str(draft / name))
    (draft / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, t in shards.items() for k in t}}))
    return root


def _copy(good, name, tmp_path):
    return shutil.copytree(good / name, tmp_path / f"bad_{name}")


def _truncate(path, keep=100):
    path.write_bytes(path.read_bytes()[:keep])


# Each case: (tool, the bad input built from good copies, its argv, words the line must hold)
def _hf_truncated(good, tmp):
    d = _copy(good, "hf", tmp)
    _truncate(d / "model.safetensors", 1000)
    return d, d / "model.safetensors", "truncated or corrupt"


def _hf_foreign(good, tmp):
    d = _copy(good, "hf", tmp)
    (d / "model.safetensors").write_bytes(b"PK\x03\x04 this is a zip, not safetensors" * 8)
    return d, d / "model.safetensors", "not a readable safetensors file"


def _hf_config_not_json(good, tmp):
    d = _copy(good, "hf", tmp)
    (d / "config.json").write_text("{'model_type': 'llama'")
    return d, d / "config.json", "not valid JSON"


def _hf_index_names_absent_file(good, tmp):
    d = _copy(good, "hf", tmp)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    return d, d / "model.safetensors.index.json", "model-00002-of-00002.safetensors"


def _hf_missing(good, tmp):
    return tmp / "nowhere", tmp / "nowhere", "does not exist"


def _ckpt_truncated(good, tmp):
    d = _copy(good, "ckpt", tmp)
    shard = sorted(d.glob("*.distcp"))[0]
    _truncate(shard)
    return d, shard, "is truncated"


def _ckpt_shard_missing(good, tmp):
    d = _copy(good, "ckpt", tmp)
    shard = sorted(d.glob("*.distcp"))[-1]
    shard.unlink()
    return d, shard, "is missing"


def _ckpt_corrupt(good, tmp):
    d = _copy(good, "ckpt", tmp)
    shard = sorted(d.glob("*.distcp"))[0]
    shard.write_bytes(b"\x07" * shard.stat().st_size)  # right length, wrong bytes
    return d, d, "could not be read"


def _ckpt_meta_not_json(good, tmp):
    d = _copy(good, "ckpt", tmp)
    (d / "specdec_checkpoint.json").write_text('{"format_version": ')
    return d, d / "specdec_checkpoint.json", "corrupt"


def _ckpt_is_hf_dir(good, tmp):
    return good / "hf", good / "hf", "not a complete megatron_specdec checkpoint"


def _draft_truncated(good, tmp):
    d = _copy(good, "draft", tmp)
    _truncate(d / "model-00002-of-00002.safetensors", 60)
    return d, d / "model-00002-of-00002.safetensors", "truncated or corrupt"


def _draft_config_not_json(good, tmp):
    d = _copy(good, "draft", tmp)
    (d / "config.json").write_text("architectures: [LlamaForCausalLMEagle3]")
    return d, d / "config.json", "not valid JSON"


def _draft_index_names_absent_file(good, tmp):
    d = _copy(good, "draft", tmp)
    (d / "model-00002-of-00002.safetensors").unlink()
    return d, d / "model.safetensors.index.json", "model-00002-of-00002.safetensors"


def _draft_index_not_json(good, tmp):
    d = _copy(good, "draft", tmp)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    return d, d / "model.safetensors.index.json", "not valid JSON"


def _draft_not_a_draft(good, tmp):
    return good / "ckpt", good / "ckpt" / "config.json", "not an HF draft directory"


HF_CASES = [_hf_truncated, _hf_foreign, _hf_config_not_json, _hf_index_names_absent_file]
CKPT_CASES = [_ckpt_truncated, _ckpt_shard_missing, _ckpt_meta_not_json, _ckpt_is_hf_dir]
DRAFT_CASES = [_draft_truncated, _draft_config_not_json, _draft_index_names_absent_file,
               _draft_index_not_json, _draft_not_a_draft]


def _argv(tool, bad, good, out):
    if tool is hf_to_megatron:
        return ["--model", bad, "--out", out]
    if tool in (megatron_to_hf, export_draft):
        return ["--model", bad, "--out", out]
    if tool is convert_speculative:
        return ["--model", bad, "--algo", "medusa", "--out", out]
    if tool is prune_depth:
        return ["--model", bad, "--num-layers", 1, "--data", DATA, "--out", out]
    if tool is import_draft:
        return ["--draft", bad, "--model", good / "ckpt", "--out", out]
    return ["--draft", bad, "--model", good / "hf", "--data", DATA, "--out", out]


CASES = ([(hf_to_megatron, c) for c in HF_CASES + [_hf_missing]]
         + [(prune_depth, c) for c in HF_CASES + [_ckpt_truncated, _ckpt_corrupt]]
         + [(megatron_to_hf, c) for c in CKPT_CASES + [_ckpt_corrupt]]
         + [(export_draft, c) for c in CKPT_CASES]
         + [(convert_speculative, c) for c in CKPT_CASES + [_ckpt_corrupt]]
         + [(import_draft, c) for c in DRAFT_CASES]
         + [(recalibrate_draft_vocab, c) for c in DRAFT_CASES])


@pytest.mark.parametrize("tool,case", CASES,
                         ids=[f"{t.__name__.split('.')[-1]}-{c.__name__[1:]}" for t, c in CASES])
def test_bad_input_is_one_line_naming_the_file(good, tmp_path, capsys, tool, case):
    bad, named, words = case(good, tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()
    code = run_cli(lambda: tool.main([str(a) for a in _argv(tool, bad, good, out)]))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert str(named) in errors[0] and words in errors[0], errors[0]
    assert not out.exists()


def test_the_script_prints_one_line_and_no_traceback(good, tmp_path):
    """The same through `python checkpoint_tools/...py`, as a user runs it: stderr is the one
    line (no log line, no traceback)."""
    bad, named, words = _draft_truncated(good, tmp_path)
    run = subprocess.run(
        [sys.executable, "checkpoint_tools/import_draft.py", "--draft", str(bad), "--model",
         str(good / "ckpt"), "--out", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith(f"error: {named}: not a readable safetensors file"), lines[0]

"""Bad input to the converters gets a clear error naming what is wrong, and nothing that is
half-written is ever loaded."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_tools import hf_to_megatron, megatron_to_hf
from conftest import REPO
from megatron_specdec.checkpointing import checkpoint


def _run_cli(module, args, capsys):
    rc = __import__("megatron_specdec.cli.common", fromlist=["run_cli"]).run_cli(lambda: module.main(args))
    return rc, capsys.readouterr().err


def test_unsupported_architecture_is_named_with_supported_list(tmp_path, capsys):
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=64,
               n_head=4).save_pretrained(tmp_path / "gpt2")
    rc, err = _run_cli(hf_to_megatron, ["--model", str(tmp_path / "gpt2"), "--out",
                                        str(tmp_path / "out")], capsys)
    assert rc == 2
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err and "Qwen3ForCausalLM" in err
    assert not (tmp_path / "out").exists()


@pytest.fixture()
def small_hf_dir(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _edit_weights(hf_dir, edit):
    path = hf_dir / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def test_missing_tensor_is_named(small_hf_dir, tmp_path, capsys):
    _edit_weights(small_hf_dir, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    rc, err = _run_cli(hf_to_megatron, ["--model", str(small_hf_dir), "--out",
                                        str(tmp_path / "out")], capsys)
    assert rc == 2
    assert "model.layers.1.mlp.up_proj.weight" in err and "missing" in err
    assert not (tmp_path / "out").exists()


def test_wrongly_shaped_tensor_is_named_with_expected_and_found(small_hf_dir, tmp_path, capsys):
    _edit_weights(small_hf_dir, lambda s: s.update(
        {"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 60)}))
    rc, err = _run_cli(hf_to_megatron, ["--model", str(small_hf_dir), "--out",
                                        str(tmp_path / "out")], capsys)
    assert rc == 2
    assert "model.layers.0.self_attn.o_proj.weight" in err
    assert "(64, 64)" in err and "(64, 60)" in err


def test_non_empty_output_is_not_overwritten_without_flag(small_hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    rc, err = _run_cli(hf_to_megatron, ["--model", str(small_hf_dir), "--out", str(out)], capsys)
    assert rc == 2 and "--overwrite" in err
    rc, err = _run_cli(megatron_to_hf, ["--model", str(out), "--out", str(out)], capsys)
    assert rc == 2 and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "precious"
    rc, _ = _run_cli(hf_to_megatron, ["--model", str(small_hf_dir), "--out", str(out),
                                      "--overwrite"], capsys)
    assert rc == 0 and not (out / "keep.txt").exists()
    checkpoint.read_meta(out)


def test_interrupted_save_is_never_loaded(default_hf_dir, tmp_path):
    """SIGKILL an import mid-save: the target name never appears, and a directory without
    the completion record is refused by every loader."""
    target = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "checkpoint_tools" / "hf_to_megatron.py"),
         "--model", str(default_hf_dir), "--out", str(target)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 600  # breaks as soon as the save starts; a loaded machine is slow
    while time.time() < deadline and proc.poll() is None:
        if list(tmp_path.glob(".ckpt.tmp-*/*")):
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"the import ended before it could be interrupted: {proc.stderr.read()}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = list(tmp_path.glob(".ckpt.tmp-*"))
    assert partial and not target.exists()
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.read_meta(target)
    with pytest.raises(checkpoint.CheckpointError, match="not a complete"):
        checkpoint.read_meta(partial[0])

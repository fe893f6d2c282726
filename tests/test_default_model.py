"""The materialised default model: a cache with the wrong eos (as transformers 5.14 wrote one)
is rebuilt, not trusted."""

import json
import shutil

import pytest

from megatron_specdec.models import default_model


def test_the_materialised_tokenizer_names_the_config_eos(default_hf_dir):
    from transformers import AutoTokenizer

    assert default_model.cached_eos_is_sound(default_hf_dir)
    config = json.loads((default_hf_dir / "config.json").read_text())
    assert AutoTokenizer.from_pretrained(default_hf_dir).eos_token_id == config["eos_token_id"]


def _stale_copy(default_hf_dir, cache):
    """The small files of the cache, with the eos a transformers 5.14 cache names."""
    stale = cache / default_model.DEFAULT_MODEL_NAME
    stale.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(default_hf_dir / name, stale / name)
    tokenizer_config = json.loads((default_hf_dir / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|im_start|>"
    (stale / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return stale


def test_a_wrong_eos_or_a_missing_file_is_not_sound(default_hf_dir, tmp_path):
    stale = _stale_copy(default_hf_dir, tmp_path)
    assert not default_model.cached_eos_is_sound(stale)
    (stale / "tokenizer_config.json").unlink()
    assert not default_model.cached_eos_is_sound(stale)


@pytest.mark.slow
def test_a_stale_cache_is_materialised_again(default_hf_dir, tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    stale = _stale_copy(default_hf_dir, tmp_path)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with caplog.at_level("WARNING", logger=default_model.__name__):
        rebuilt = default_model.default_model_dir()
    assert rebuilt == stale and "eos" in caplog.text
    assert (rebuilt / "model.safetensors").is_file()
    assert AutoTokenizer.from_pretrained(rebuilt).eos_token == "<|im_end|>"
    assert sorted(p.name for p in tmp_path.iterdir()) == [default_model.DEFAULT_MODEL_NAME]

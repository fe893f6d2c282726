"""The front door (loading.load_model): an HF directory, a base checkpoint, a speculative
checkpoint and its base alone load to the same base logits; 'default' is the embedded model;
a source that is none of these is refused naming the path and the forms accepted."""

import json
import shutil

import pytest
import torch

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec import distributed
from megatron_specdec.loading import source as loading

HF = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          intermediate_size=128, vocab_size=300, max_position_embeddings=64,
          tie_word_embeddings=False)
PROMPT = torch.tensor([[5, 17, 42, 7, 99, 3]])


@pytest.fixture(scope="module")
def sources(module_tmp):
    """{form: path}: a random HF Llama, its base checkpoint and a speculative one (Medusa)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_specdec.loading.hf_conversion import hf_to_megatron
    from megatron_specdec.loading.conversion import convert_checkpoint

    torch.manual_seed(0)
    root = module_tmp("forms")
    LlamaForCausalLM(LlamaConfig(**HF)).save_pretrained(root / "hf")
    distributed.initialize(1, 1)
    hf_to_megatron(root / "hf", root / "base")
    convert_checkpoint(root / "base", root / "spec", "medusa", {"medusa_num_heads": 2})
    yield {"hf": root / "hf", "base": root / "base", "spec": root / "spec"}
    distributed.destroy()  # leave no process group behind for other test modules


def _logits(gpt):
    with torch.no_grad():
        out = gpt(PROMPT, torch.arange(PROMPT.shape[1])[None], None)
    return out[..., :HF["vocab_size"]]


def test_every_form_loads_to_the_same_logits(sources):
    from megatron_specdec.models.speculative_gpt import SpeculativeGPTModel

    hf = loading.load_model(sources["hf"])
    assert hf.draft is None and hf.tokenizer_dir == sources["hf"]
    reference = _logits(hf.model)
    base = loading.load_model(sources["base"])
    assert base.draft is None and base.tokenizer_dir == sources["base"] / checkpoint.TOKENIZER_DIR
    assert base.base_meta == checkpoint.base_meta_of(checkpoint.read_meta(sources["base"]))
    spec = loading.load_model(sources["spec"])
    assert isinstance(spec.model, SpeculativeGPTModel) and spec.draft["algo"] == "medusa"
    assert spec.base_meta == base.base_meta  # one stripper: no draft or layout in it
    base_only = loading.load_model(sources["spec"], with_draft=False)
    assert base_only.draft is None and not isinstance(base_only.model, SpeculativeGPTModel)
    for loaded in (base.model, spec.model.base, base_only.model):
        assert not loaded.training
        torch.testing.assert_close(_logits(loaded), reference, rtol=0, atol=1e-5)


def test_a_speculative_load_reads_its_metadata_once(sources, monkeypatch):
    """identify reads and vets metadata.json once; the rebuild and the load take it from there."""
    reads = []
    read_meta = checkpoint.read_meta
    monkeypatch.setattr(checkpoint, "read_meta",
                        lambda path: reads.append(path) or read_meta(path))
    for form in ("spec", "base"):
        reads.clear()
        loading.load_model(sources[form])
        assert reads == [sources[form]], (form, reads)


def test_identify_tells_the_forms_apart(sources):
    from megatron_specdec.models.default_model import default_model_dir

    forms = {name: loading.identify(path).form for name, path in sources.items()}
    assert forms == {"hf": loading.HF, "base": loading.BASE, "spec": loading.SPECULATIVE}
    default = loading.identify("default")
    assert default.form == loading.HF and default.path == default_model_dir()


def test_bad_sources_name_the_path_and_the_forms(sources, tmp_path):
    with pytest.raises(loading.ModelSourceError,
                       match=rf"{tmp_path / 'missing'}: no such file.*expected an HF model "
                             r"directory.*'default'.*base megatron_specdec checkpoint.*"
                             r"speculative checkpoint"):
        loading.load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(loading.ModelSourceError,
                       match=rf"{tmp_path / 'empty'} is none of the forms.*found neither"):
        loading.load_model(tmp_path / "empty")
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"{sources['base']} is a base checkpoint: it holds no draft"):
        loading.load_model(sources["base"], need_draft=True)
    # A trainer's checkpoint (draft and optimizer state only) is named as such.
    trainer = tmp_path / "trainer"
    shutil.copytree(sources["base"].resolve(), trainer)
    meta = json.loads((trainer / checkpoint.META_FILE).read_text())
    meta["training_checkpoint"] = {"draft": {"algo": "eagle3"}, "step": 1}
    (trainer / checkpoint.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(loading.ModelSourceError, match=rf"{trainer} is a training checkpoint"):
        loading.load_model(trainer)

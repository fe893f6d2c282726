"""A draft method added from outside the package (tests/toy_method.py) trains, generates and
exports through the registry alone: the trainer, the generator and export_draft reach it by
name, and nothing in megatron_specdec knows it."""

import json

import pytest
import torch

import toy_method
import train_support as ts
from megatron_specdec import distributed, registry


@pytest.fixture(scope="module")
def trained(module_tmp):
    root = module_tmp("toy_method")
    model = ts.make_tiny_model(root / "model")
    data = ts.write_conversations(root / "conv.jsonl", n=8)
    out = root / "run"
    argv = ts.overrides(model, data, out, **{"training.steps": 2, "checkpointing.interval": 0,
                                              "draft.algo": toy_method.NAME})
    argv = [a for a in argv if not a.startswith("draft.config.")]
    result = root / "result.pt"
    distributed.spawn(toy_method.train_worker, 1, argv, str(result))
    registry.register(toy_method.METHOD, replace=True)  # this process reads its checkpoint
    yield torch.load(result, weights_only=False), out / "final", root
    registry.unregister(toy_method.NAME)


def test_unknown_and_old_spellings_are_refused_with_the_valid_names():
    for name in ("draft-model", "eagle", "toy"):
        with pytest.raises(registry.UnknownMethodError, match="expected one of: eagle3, medusa, draft_model, ngram"):
            registry.get(name)


def test_plugin_trains_generates_and_exports(trained, one_process):
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.data import end_of_turn_ids, load_tokenizer
    from megatron_specdec.inference import SpeculativeGenerator
    from megatron_specdec.inference.generation import plain_generate
    from megatron_specdec.loading.source import load_model
    from checkpoint_tools import export_draft

    summary, final, root = trained
    assert summary["steps"] == 2 and summary["algo"] == toy_method.NAME, summary
    assert checkpoint.read_meta(final)["draft"]["algo"] == toy_method.NAME

    loaded = load_model(final, need_draft=True)
    model = loaded.model
    assert isinstance(model.draft, torch.nn.Module) and model.method is toy_method.METHOD
    tokenizer = load_tokenizer(str(loaded.tokenizer_dir))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 4 plus 13?"}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    eos = end_of_turn_ids(tokenizer)
    result = SpeculativeGenerator(model, policy="fixed").generate(list(prompt), 12, eos)
    plain = plain_generate(model.base, [list(prompt)], 12, model.vocab_size, eos)[0]
    assert result.tokens == plain  # lossless: the toy drafts, the base decides
    assert sum(result.drafted) > 0  # it did draft

    out = root / "hf"
    export_draft.main(["--model", str(final), "--out", str(out)])
    from safetensors.torch import load_file

    exported = load_file(str(out / "toy_head.safetensors"))["lm_head.weight"]
    assert torch.equal(exported, model.draft.proj.weight.detach().cpu())
    assert json.loads((out / "config.json").read_text())["architectures"] == ["ToyHead"]

"""Bad draft models are refused before anything is loaded, naming what is wrong: another
vocabulary size (both sizes named), another tokenizer (both directories named), a
speculative checkpoint or an HF EAGLE3 directory (not a plain GPT), an unsupported
architecture, and --drafter draft_model without --draft-model (or the reverse)."""

import json
import shutil
from argparse import Namespace

import pytest

from megatron_specdec.checkpointing import checkpoint
from megatron_specdec import distributed
from test_draft_model_generation import save_draft


def word_tokenizer(path, words):
    """A tiny word-level tokenizer directory (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *words])}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, "<unk>")),
                                   unk_token="<unk>")
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def draft(module_tmp):
    """(a saved one-layer draft checkpoint with tokenizer A, tokenizer A, tokenizer B)."""
    root = module_tmp("draft")
    distributed.initialize(1, 1)
    ours = word_tokenizer(root / "tok_a", ["red", "green"])
    save_draft(root / "ckpt", [0], tokenizer_dir=ours)
    return root / "ckpt", ours, word_tokenizer(root / "tok_b", ["red", "blue"])


def edited(src, dst, edit):
    """A copy of checkpoint `src` whose metadata `edit` changed."""
    shutil.copytree(src, dst)
    meta = json.loads((dst / checkpoint.META_FILE).read_text())
    edit(meta)
    (dst / checkpoint.META_FILE).write_text(json.dumps(meta))
    return dst


def test_matching_draft_passes(draft):
    from megatron_specdec.methods.draft_model.proposer import check_draft_checkpoint

    path, ours, _ = draft
    assert check_draft_checkpoint(path, 512, ours)["hf_config"]["vocab_size"] == 512


def test_other_vocabulary_size_is_refused_naming_both(draft, tmp_path):
    from megatron_specdec.methods.draft_model.proposer import check_draft_checkpoint

    bigger = edited(draft[0], tmp_path / "d", lambda m: m["hf_config"].update(vocab_size=640))
    with pytest.raises(ValueError, match=r"vocab_size 640 .*the target's is 512"):
        check_draft_checkpoint(bigger, 512)


def test_other_tokenizer_is_refused_naming_both(draft):
    from megatron_specdec.methods.draft_model.proposer import check_draft_checkpoint

    path, _, theirs = draft
    with pytest.raises(ValueError, match="tokenizer") as error:
        check_draft_checkpoint(path, 512, theirs)
    assert str(path / checkpoint.TOKENIZER_DIR) in str(error.value)
    assert str(theirs) in str(error.value) and "blue" in str(error.value)


def test_speculative_checkpoint_is_refused_by_name(draft, tmp_path):
    from megatron_specdec.methods.draft_model.proposer import check_draft_checkpoint

    spec = edited(draft[0], tmp_path / "d", lambda m: m.update(draft={"algo": "eagle3"}))
    with pytest.raises(checkpoint.CheckpointError, match="speculative checkpoint.*eagle3"):
        check_draft_checkpoint(spec, 512)


def test_unsupported_architecture_is_refused_by_name(draft, tmp_path):
    from megatron_specdec.methods.draft_model.proposer import check_draft_checkpoint

    gpt2 = edited(draft[0], tmp_path / "d",
                  lambda m: m["hf_config"].update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(checkpoint.CheckpointError, match="not a GPT.*GPT2LMHeadModel"):
        check_draft_checkpoint(gpt2, 512)


def test_hf_eagle3_directory_is_refused_by_name(tmp_path):
    from megatron_specdec.methods.draft_model.proposer import check_draft_checkpoint

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(checkpoint.CheckpointError, match="LlamaForCausalLMEagle3"):
        check_draft_checkpoint(tmp_path, 512)


@pytest.mark.parametrize("drafter,path", [("draft_model", None), ("ngram", "somewhere")])
def test_draft_model_flags_go_together(drafter, path):
    from megatron_specdec.cli.validate import check_draft_model_args

    with pytest.raises(ValueError, match="--draft-model"):
        check_draft_model_args(Namespace(drafter=drafter, draft_model=path), 512, None)

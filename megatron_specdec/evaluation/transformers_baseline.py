"""Stock transformers `generate` on the base a checkpoint was converted from: the decoding a
user would run instead of this project, timed beside it on the same prompts (`validate
--transformers`, `make demo`, bench/bench_generation.py)."""

from pathlib import Path

import torch


def hf_base_dir(ckpt, override=None, flag="--transformers") -> Path:
    """The HF directory of a checkpoint's base: `override` (the value of `flag`), else the
    directory it was converted from (its `hf_config._name_or_path`); an error naming `flag`
    where that holds no HF model."""
    from megatron_specdec.checkpointing import checkpoint

    if override is not None:
        if not (Path(override) / "config.json").is_file():
            raise FileNotFoundError(f"{flag}: {override} is not an HF model directory "
                                    f"(no config.json)")
        return Path(override)
    recorded = checkpoint.read_meta(ckpt)["hf_config"].get("_name_or_path") or ""
    if not recorded or not (Path(recorded) / "config.json").is_file():
        where = (f"was converted from {recorded}, which holds no HF model now" if recorded
                 else "records no HF directory of its base")
        raise FileNotFoundError(f"{flag}: checkpoint {ckpt} {where}; pass {flag} DIR "
                                f"(checkpoint_tools/megatron_to_hf.py writes one)")
    return Path(recorded)


def load_transformers(hf_dir, dtype=torch.float32):
    """The HF causal LM in `hf_dir`, in `dtype` (the project model's, for a fair race)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()


def hf_generate(hf_model, ids, max_new_tokens, eos, **kwargs) -> list:
    """The new tokens of transformers `generate` for one prompt (greedy, or with the given
    generation settings, e.g. an assistant), without the stop token, as this project's
    generators return them."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=list(eos), pad_token_id=0, **kwargs)
    tokens = out[0, len(ids):].tolist()
    while tokens and tokens[-1] in eos:
        tokens.pop()
    return tokens

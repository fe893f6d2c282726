"""Shared pieces of the tests/test_train_*.py modules: a tiny random Llama with SmolLM2's
tokenizer and chat template, short conversations, and a trainer worker for
`distributed.spawn` that can stop a run after step k as a kill would (the steps after the
last checkpoint are lost) and records the outcome."""

import json
import logging
import shutil
from pathlib import Path

import torch

from megatron_specdec import distributed


class Killed(Exception):
    pass


def make_tiny_model(out: Path, seed: int = 0) -> Path:
    """A 4-layer h=64 Llama (random from `seed`) in an HF directory with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_specdec.models.default_model import default_model_dir

    config = LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=49152,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    for f in default_model_dir().iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


def conversation(i: int) -> dict:
    a, b = 3 + i, 11 + 2 * i
    return {"id": f"sum:{i}", "conversations": [
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}


def write_conversations(path: Path, n: int = 16, bad_lines=()) -> Path:
    lines = [json.dumps(conversation(i)) for i in range(n)]
    for lineno, text in bad_lines:  # 1-based line numbers of inserted bad rows
        lines.insert(lineno - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return path


def overrides(model_dir, data, out_dir, **extra) -> list:
    """A small EAGLE3 run: 2 samples a step (2 micro-batches of 1), packed rows of 64."""
    base = {"output_dir": out_dir, "model.path": model_dir, "data.train": f"[{data}]",
            "data.seq_length": 64, "training.steps": 4, "training.micro_batch_size": 1,
            "training.global_batch_size": 2, "draft.config.draft_vocab_size": 256,
            "draft.config.ttt_steps": 2, "checkpointing.interval": 2,
            "logging.progress_bar": "false", "logging.tensorboard": "false",
            "optimizer.lr": 1e-2, "optimizer.warmup_steps": 1}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_worker(argv, kill_after, result_file, log_file=None):
    """Train the recipe `argv` (overrides); with `kill_after`, stop right after that step.
    Saves the summary, 'killed', or 'error: <message>' to `result_file` (rank 0)."""
    import torch.distributed as dist

    from megatron_specdec.training import load_recipe, metrics, train

    if log_file is not None:
        handler = logging.FileHandler(log_file)
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
    if kill_after is not None:
        original = metrics.Reporter.step

        def step(self, n, *args):
            original(self, n, *args)
            if n == kill_after:
                raise Killed

        metrics.Reporter.step = step
    try:
        result = train(load_recipe(None, argv))
    except Killed:
        result = "killed"
    except Exception as e:  # the test inspects the message
        result = f"error: {type(e).__name__}: {e}"
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, result_file)


def run(argv, world_size=1, kill_after=None, log_file=None, tmp=None):
    """Run `train_worker` on `world_size` fresh processes; returns its recorded result."""
    result_file = Path(tmp or argv_output_dir(argv)) / f"result_{id(argv)}.pt"
    distributed.spawn(train_worker, world_size, argv, kill_after, str(result_file),
                      None if log_file is None else str(log_file))
    result = torch.load(result_file, weights_only=False)
    result_file.unlink()
    return result


def argv_output_dir(argv) -> Path:
    out = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("output_dir=")))
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent


def losses(out_dir) -> list:
    from megatron_specdec.training.metrics import read_log

    log = read_log(out_dir)
    return [log[s]["loss"] for s in sorted(log)]

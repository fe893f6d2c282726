"""Synthetic user prompts written by the target itself (Magpie-style self-instruction).

The shipped prompt sets hold few general-domain prompts (data/sources: 427 Self-Instruct
against 7,473 GSM8K), so a draft trained on them is tuned to arithmetic. An instruct model
given only the chat template up to the start of a user turn writes a plausible user request;
sampling that prefix many times yields prompts in the target's own domain of conversation,
which `regenerate` then answers greedily. Nothing is taken from an evaluation set.

Work goes in fixed batches: batch n samples rows `synth-<seed>-<n * batch + i>` with seed
`seed + n`, so a restarted run redoes exactly the batches it has not written. A batch counts as
done once any of its rows is written; rows cut off by the length budget, empty, or repeating an
earlier prompt are dropped.

A system prompt steers a 135M model only weakly (asked for code, SmolLM2 still writes mostly
trivia questions). `user_prefixes` steer harder: row i's user text starts with prefix
i mod len(prefixes) ("Write a Python function that", "Pretend you are"), which the model
continues; the kept prompt is the prefix plus its continuation.
"""

import json
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from tqdm import tqdm

from megatron_specdec.data.conversations import end_of_turn_ids
from megatron_specdec.data.jsonl import DataError, DurableJsonlWriter

log = logging.getLogger(__name__)

_SENTINEL = "\x00USER\x00"


def user_turn_prefix(tokenizer, system_prompt: Optional[str] = None) -> list:
    """Token ids of the chat template up to where a user message's text begins."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    text = tokenizer.apply_chat_template(
        messages + [{"role": "user", "content": _SENTINEL}], tokenize=False
    )
    if _SENTINEL not in text:
        raise DataError("the tokenizer's chat template does not render the user message text")
    prefix = text[: text.index(_SENTINEL)]
    return tokenizer(prefix, add_special_tokens=False)["input_ids"]


@dataclass
class SynthStats:
    written: int
    dropped: int
    batches_done: int
    seconds: float


def _batch_of(row_id: str, batch_size: int) -> int:
    return int(row_id.rsplit("-", 1)[1]) // batch_size


def synthesize_prompts(
    backend,
    tokenizer,
    out_path,
    num_prompts: int,
    batch_size: int = 256,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    min_chars: int = 16,
    system_prompt: Optional[str] = None,
    user_prefixes: Sequence[str] = (),
    progress: bool = True,
) -> SynthStats:
    """Sample `num_prompts` candidate user turns into `out_path` ({"id", "prompt"} rows);
    resumable. `backend.sample(prompts, max_new_tokens, temperature, top_p, seed)` draws them."""
    if num_prompts <= 0 or batch_size <= 0 or max_new_tokens <= 0:
        raise DataError(
            f"num_prompts, batch_size and max_new_tokens must be positive, got "
            f"{num_prompts}, {batch_size}, {max_new_tokens}"
        )
    template = user_turn_prefix(tokenizer, system_prompt)
    starts = list(user_prefixes) or [""]
    if any(not s.strip() for s in user_prefixes):
        raise DataError("user_prefixes: an empty prefix (one per line, no blank lines)")
    starts_ids = [tokenizer(s, add_special_tokens=False)["input_ids"] if s else [] for s in starts]
    eos_ids = end_of_turn_ids(tokenizer)
    num_batches = -(-num_prompts // batch_size)
    written = dropped = 0
    start = time.monotonic()
    with DurableJsonlWriter(out_path) as writer:
        prefix_ids = f"synth-{seed}-"
        foreign = [i for i in writer.ids if not i.startswith(prefix_ids)]
        if foreign:
            raise DataError(
                f"{out_path} holds rows of another seed or file (e.g. {foreign[0]!r}); "
                f"use a new --out for seed {seed}"
            )
        done = {_batch_of(i, batch_size) for i in writer.ids}
        seen = {_normalise(r) for r in _read_prompts(out_path)}
        todo = [n for n in range(num_batches) if n not in done]
        log.info("%s: %d batches of %d to sample, %d done", out_path, len(todo), batch_size,
                 num_batches - len(todo))
        bar = tqdm(total=len(todo), unit="batch", disable=not progress, desc="synthesize")
        for n in todo:
            rows = range(n * batch_size, min((n + 1) * batch_size, num_prompts))
            prompts = [template + starts_ids[i % len(starts)] for i in rows]
            completions = backend.sample(prompts, max_new_tokens, temperature, top_p, seed + n)
            for index, ids in zip(rows, completions):
                stop = next((k for k, t in enumerate(ids) if t in eos_ids), None)
                text = tokenizer.decode(starts_ids[index % len(starts)] + ids[:stop],
                                        skip_special_tokens=True).strip()
                key = _normalise(text)
                if stop is None or len(text) < min_chars or key in seen:
                    dropped += 1
                    continue
                seen.add(key)
                writer.write({"id": f"{prefix_ids}{index:07d}", "prompt": text})
                written += 1
            bar.update(1)
            bar.set_postfix(kept=written, dropped=dropped)
        bar.close()
    stats = SynthStats(written, dropped, num_batches, time.monotonic() - start)
    log.info("kept %d prompts, dropped %d (cut off, short or repeated) in %.1f s",
             written, dropped, stats.seconds)
    return stats


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def _read_prompts(path) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]

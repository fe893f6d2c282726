"""Self-distillation data: the target model answers the training prompts itself.

The draft learns to predict what the target generates, so its training answers come from the
target (greedy), not from the datasets' reference answers. Work is split into shards by a hash
of the row id and written row by row to a `DurableJsonlWriter`, so a killed run restarted with
the same arguments skips the ids already written and appends the rest, in the same order.
"""

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence

from tqdm import tqdm

from megatron_specdec.data.conversations import end_of_turn_ids
from megatron_specdec.data.jsonl import DataError, DurableJsonlWriter
from megatron_specdec.data.sources import PRESETS

log = logging.getLogger(__name__)


class GenerationBackend(Protocol):
    """Greedy completion of chat-templated prompts.

    Returns one list of completion token ids per prompt (stopping at an end-of-turn id, which
    may be included, or after `max_new_tokens`). `messages` holds the same prompts as chat
    messages, for backends that can only take text (an OpenAI chat endpoint); others ignore it.
    """

    def generate(
        self, prompts: list, max_new_tokens: int, messages: Optional[list] = None
    ) -> list: ...


def _hash(row_id: str) -> int:
    return int.from_bytes(hashlib.sha1(row_id.encode("utf-8")).digest()[:8], "big")


def select_shard(
    rows: Sequence, shard_index: int = 0, num_shards: int = 1, limit: Optional[int] = None
) -> list:
    """This shard's rows (hash of id mod num_shards), in hash order so that a `limit` takes a mix
    of all sources; the order depends only on the ids, so restarts see the same sequence."""
    if not 0 <= shard_index < num_shards:
        raise DataError(f"--shard-index must be in [0, {num_shards}), got {shard_index}")
    mine = sorted(
        (r for r in rows if _hash(r.id) % num_shards == shard_index), key=lambda r: _hash(r.id)
    )
    return mine if limit is None else mine[:limit]


def shard_output_path(out, shard_index: int, num_shards: int) -> Path:
    """`regen.jsonl` -> `regen.shard00003-of-00008.jsonl` when sharded, so shards never share a file."""
    out = Path(out)
    if num_shards == 1:
        return out
    return out.with_name(f"{out.stem}.shard{shard_index:05d}-of-{num_shards:05d}{out.suffix}")


@dataclass
class RegenStats:
    written: int
    already_done: int
    completion_tokens: int
    seconds: float


def regenerate(
    rows: Sequence,
    backend: GenerationBackend,
    tokenizer,
    out_path,
    batch_size: int = 32,
    max_new_tokens: int = 512,
    system_prompt: Optional[str] = None,
    progress: bool = True,
) -> RegenStats:
    """Answer every user turn of `rows` with `backend` and append conversation rows to `out_path`.

    Rows whose id is already in `out_path` are skipped. Multi-turn rows are answered turn by
    turn, each turn seeing the model's own earlier answers.
    """
    eval_sources = {
        r.source for r in rows if r.source in PRESETS and PRESETS[r.source].split == "eval"
    }
    if eval_sources:
        raise DataError(f"sources {sorted(eval_sources)} are evaluation-only: never train on them")
    if batch_size <= 0 or max_new_tokens <= 0:
        raise DataError(
            f"batch_size and max_new_tokens must be positive, got {batch_size}, {max_new_tokens}"
        )
    eos_ids = end_of_turn_ids(tokenizer)
    with DurableJsonlWriter(out_path) as writer:
        pending = [r for r in rows if r.id not in writer.ids]
        foreign = len(writer.ids - {r.id for r in rows})
        if foreign:
            log.warning("%s holds %d ids that are not among this run's prompts", out_path, foreign)
        log.info(
            "%s: %d rows to generate, %d already done",
            out_path,
            len(pending),
            len(rows) - len(pending),
        )
        tokens, start = 0, time.monotonic()
        bar = tqdm(total=len(pending), unit="row", disable=not progress, desc="regenerate")
        for b in range(0, len(pending), batch_size):
            batch = pending[b : b + batch_size]
            chats, finish, batch_tokens = _answer(
                batch, backend, tokenizer, max_new_tokens, system_prompt, eos_ids
            )
            for row, chat, reasons in zip(batch, chats, finish):
                out = {
                    "id": row.id,
                    "source": row.source,
                    "conversations": chat,
                    "finish_reasons": reasons,
                }
                if row.meta:
                    out["meta"] = row.meta
                writer.write(out)
            tokens += batch_tokens
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / max(time.monotonic() - start, 1e-9):.1f}")
        bar.close()
    stats = RegenStats(len(pending), len(rows) - len(pending), tokens, time.monotonic() - start)
    log.info(
        "wrote %d rows, %d completion tokens in %.1f s (%.1f tokens/s)",
        stats.written,
        tokens,
        stats.seconds,
        tokens / max(stats.seconds, 1e-9),
    )
    return stats


def _answer(batch, backend, tokenizer, max_new_tokens, system_prompt, eos_ids):
    """Conversations, per-turn finish reasons and completion token count for a batch of rows."""
    chats = [[{"role": "system", "content": system_prompt}] if system_prompt else [] for _ in batch]
    finish = [[] for _ in batch]
    tokens = 0
    for turn in range(max(len(r.turns) for r in batch)):
        active = [j for j, r in enumerate(batch) if turn < len(r.turns)]
        for j in active:
            chats[j].append({"role": "user", "content": batch[j].turns[turn]})
        messages = [list(chats[j]) for j in active]
        prompts = [
            tokenizer(
                tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )["input_ids"]
            for m in messages
        ]
        completions = backend.generate(prompts, max_new_tokens, messages=messages)
        if len(completions) != len(prompts):
            raise DataError(
                f"backend returned {len(completions)} completions for {len(prompts)} prompts"
            )
        for j, ids in zip(active, completions):
            tokens += len(ids)
            stop = next((k for k, t in enumerate(ids) if t in eos_ids), None)
            finish[j].append("length" if stop is None else "stop")
            text = tokenizer.decode(ids[:stop], skip_special_tokens=True)
            chats[j].append({"role": "assistant", "content": text})
    return chats, finish, tokens

"""Requests about a given text: extraction, summarising and editing prompts built from passages
the target wrote earlier.

Synthesized prompts are short (a mean of 137 characters for seed 9) and carry no text to work
on, yet a share of what chat users ask (and MT-bench's extraction and writing questions) hands
the model a passage to quote, list or rework. A draft learns to copy from its context only from
answers that do so. Here each prompt is a request from a project-written list with `{text}`
replaced by a passage: an assistant answer from earlier conversations, cut at a paragraph or
sentence end. `regenerate` then answers them greedily. Deterministic in `seed`; nothing is
taken from an evaluation set.
"""

import json
import logging
import random
from pathlib import Path
from typing import Sequence

from megatron_specdec.checkpointing.checkpoint import write_text_atomic
from megatron_specdec.data.jsonl import BadRows, DataError, iter_jsonl, read_list_file

log = logging.getLogger(__name__)

PLACEHOLDER = "{text}"


def read_instructions(path) -> list:
    """Requests, one a line ('#' comments and blank lines skipped; a literal \\n is a line
    break); each must hold {text} exactly once."""
    requests = []
    for lineno, line in read_list_file(path, "--instructions", "requests"):
        if line.count(PLACEHOLDER) != 1:
            raise DataError(f"{path}:{lineno}: a request needs {PLACEHOLDER} exactly once, "
                            f"found {line.count(PLACEHOLDER)}")
        requests.append(line.replace("\\n", "\n"))
    return requests


def cut(text: str, max_chars: int) -> str:
    """`text` up to `max_chars`, ending at its last paragraph break, else sentence end, within
    that; '' when neither falls in the second half (a passage would end mid-sentence)."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for end in (head.rfind("\n\n"), max(head.rfind(". "), head.rfind(".\n"))):
        if end >= max_chars // 2:
            return head[: end + (0 if head[end] == "\n" else 1)].strip()
    return ""


def read_passages(paths: Sequence, min_chars: int, max_chars: int, on_error: str = "skip") -> list:
    """Distinct assistant turns of the conversations files, cut to `max_chars` (`cut`), of at
    least `min_chars`, in file order."""
    if not 0 < min_chars <= max_chars:
        raise DataError(f"need 0 < --min-chars <= --max-chars, got {min_chars} and {max_chars}")
    passages, seen = [], set()
    for path in paths:
        bad = BadRows(on_error)
        for lineno, row in iter_jsonl(path, bad):
            turns = row.get("conversations")
            if not isinstance(turns, list):
                bad.report(path, lineno, "no 'conversations' list")
                continue
            for turn in turns:
                if isinstance(turn, dict) and turn.get("role") == "assistant":
                    text = cut(str(turn.get("content", "")), max_chars)
                    if len(text) >= min_chars and text not in seen:
                        seen.add(text)
                        passages.append(text)
        bad.summarize(path)
    return passages


def grounded_prompts(passages: Sequence, requests: Sequence, num_prompts: int, seed: int) -> list:
    """`num_prompts` rows {id, prompt}: distinct passages, each in a request drawn at random."""
    if num_prompts > len(passages):
        raise DataError(f"--num-prompts {num_prompts}: only {len(passages)} passages qualify "
                        f"(add --conversations files or widen --min-chars/--max-chars)")
    rng = random.Random(seed)
    chosen = rng.sample(range(len(passages)), num_prompts)
    return [{"id": f"ground-{seed}-{i:07d}",
             "prompt": rng.choice(requests).replace(PLACEHOLDER, passages[p])}
            for i, p in enumerate(chosen)]


def write_prompts(rows: Sequence, out) -> None:
    """jsonl at `out`, written to a temporary file and renamed into place."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    log.info("%d grounded prompts -> %s", len(rows), out)

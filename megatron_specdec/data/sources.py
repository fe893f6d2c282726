"""Prompt sources: jsonl files mapped to user turns through a small field mapping.

A row becomes a `PromptRow` whose id is `<source name>:<line number>`: stable across runs as
long as the file is unchanged, which is what sharded and resumed regeneration dedupes on.
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from megatron_specdec.data.jsonl import BadRows, DataError, iter_jsonl

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class SourceSpec:
    """How to read prompts from one jsonl file.

    Field paths are dotted and may index lists (`instances.0.input`). Exactly one of
    `prompt` (a single user turn) and `turns` (a list of user turns) is set; `context`, when
    present and non-empty, is appended to the prompt after a blank line (Self-Instruct inputs).
    `split="eval"` marks evaluation-only data that regeneration refuses to train on.
    """

    name: str
    file: str
    prompt: Optional[str] = None
    context: Optional[str] = None
    turns: Optional[str] = None
    meta: tuple = ()
    split: str = "train"

    def __post_init__(self):
        if (self.prompt is None) == (self.turns is None):
            raise DataError(f"source {self.name!r}: set exactly one of 'prompt' and 'turns'")
        if self.context is not None and self.prompt is None:
            raise DataError(f"source {self.name!r}: 'context' needs 'prompt'")
        if self.split not in SPLITS:
            raise DataError(
                f"source {self.name!r}: split must be one of {SPLITS}, got {self.split!r}"
            )
        object.__setattr__(self, "meta", tuple(self.meta))


@dataclass(frozen=True)
class PromptRow:
    id: str
    source: str
    turns: tuple
    meta: dict = field(default_factory=dict)


PRESETS = {
    spec.name: spec
    for spec in (
        SourceSpec("gsm8k", "gsm8k_train.jsonl", prompt="question"),
        SourceSpec(
            "self_instruct_seed",
            "self_instruct_seed_tasks.jsonl",
            prompt="instruction",
            context="instances.0.input",
        ),
        SourceSpec(
            "self_instruct_user",
            "self_instruct_user_oriented.jsonl",
            prompt="instruction",
            context="instances.0.input",
        ),
        SourceSpec(
            "mt_bench",
            "mt_bench.jsonl",
            turns="turns",
            meta=("question_id", "category"),
            split="eval",
        ),
    )
}
TRAIN_PRESETS = tuple(name for name, spec in PRESETS.items() if spec.split == "train")


def parse_source(text: Union[str, dict, SourceSpec]) -> SourceSpec:
    """A preset name, a JSON object / dict of `SourceSpec` fields, or a `SourceSpec`."""
    if isinstance(text, SourceSpec):
        return text
    if isinstance(text, str) and not text.lstrip().startswith("{"):
        if text not in PRESETS:
            raise DataError(f"unknown source {text!r}; presets: {', '.join(PRESETS)}")
        return PRESETS[text]
    try:
        fields = json.loads(text) if isinstance(text, str) else dict(text)
        return SourceSpec(**fields)
    except (json.JSONDecodeError, TypeError) as e:
        raise DataError(f"bad source spec {text!r}: {e}") from None


class _Missing(Exception):
    pass


def _lookup(row, path: str):
    value = row
    for key in path.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise _Missing(path)
    return value


def _turns(spec: SourceSpec, row: dict) -> tuple:
    """The row's user turns; raises ValueError with the reason when the row is bad."""
    try:
        if spec.turns is not None:
            turns = _lookup(row, spec.turns)
            if (
                not isinstance(turns, list)
                or not turns
                or not all(isinstance(t, str) for t in turns)
            ):
                raise ValueError(f"field {spec.turns!r} must be a non-empty list of strings")
            turns = [t.strip() for t in turns]
        else:
            prompt = _lookup(row, spec.prompt)
            if not isinstance(prompt, str):
                raise ValueError(
                    f"field {spec.prompt!r} must be a string, got {type(prompt).__name__}"
                )
            context = ""
            if spec.context is not None:
                try:
                    context = _lookup(row, spec.context)
                except _Missing:
                    pass
                if not isinstance(context, str):
                    raise ValueError(
                        f"field {spec.context!r} must be a string, got {type(context).__name__}"
                    )
            turns = ["\n\n".join(part.strip() for part in (prompt, context) if part.strip())]
    except _Missing as e:
        raise ValueError(f"missing field {e.args[0]!r}") from None
    if not all(turns):
        raise ValueError("empty prompt")
    return tuple(turns)


def read_source(spec, data_dir=None, on_error: str = "skip") -> list:
    """All prompt rows of one source; `data_dir` resolves relative file names."""
    spec = parse_source(spec)
    path = Path(spec.file)
    if not path.is_absolute():
        if data_dir is None:
            raise DataError(
                f"source {spec.name!r} names a relative file {spec.file!r}: pass a data dir (--data-dir)"
            )
        path = Path(data_dir) / path
    bad_rows = BadRows(on_error)
    rows = []
    for lineno, row in iter_jsonl(path, bad_rows):
        try:
            turns = _turns(spec, row)
        except ValueError as e:
            bad_rows.report(path, lineno, str(e))
            continue
        meta = {key: row[key] for key in spec.meta if key in row}
        rows.append(PromptRow(f"{spec.name}:{lineno}", spec.name, turns, meta))
    bad_rows.summarize(path)
    log.info("source %s: %d prompt rows from %s", spec.name, len(rows), path)
    return rows


def read_sources(specs: Sequence, data_dir=None, on_error: str = "skip") -> list:
    """Prompt rows of several sources, in the given order; source names must be distinct."""
    specs = [parse_source(s) for s in specs]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise DataError(f"source names must be distinct (they prefix row ids): {names}")
    return [row for spec in specs for row in read_source(spec, data_dir, on_error)]

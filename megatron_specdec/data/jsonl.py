"""JSON-lines reading with file:line error reports, and a kill-safe append-only writer."""

import fcntl
import gzip
import json
import logging
import os
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

ON_ERROR_CHOICES = ("skip", "fail")
# Bad rows beyond this many are counted but not logged one by one.
MAX_LOGGED_BAD_ROWS = 20


class DataError(ValueError):
    """A data file or setting is unusable; the message names the file (and line) or flag."""


class BadRows:
    """Applies the `on_error` policy to bad rows: `fail` raises at the first one, `skip` counts them."""

    def __init__(self, on_error: str = "skip"):
        if on_error not in ON_ERROR_CHOICES:
            raise DataError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")
        self.on_error = on_error
        self.count = 0

    def report(self, path, lineno: int, reason: str) -> None:
        message = f"{path}:{lineno}: {reason}"
        if self.on_error == "fail":
            raise DataError(f"bad row {message} (set on_error=skip to skip bad rows)")
        self.count += 1
        if self.count <= MAX_LOGGED_BAD_ROWS:
            log.warning("skipping bad row %s", message)

    def summarize(self, path) -> None:
        if self.count:
            log.warning("%s: skipped %d bad row(s)", path, self.count)


def read_list_file(path, flag: str, what: str) -> list:
    """(1-based line number, stripped text) of each entry of a one-entry-a-line text file named
    by `flag`; blank lines and lines starting with '#' are skipped. Unreadable or empty: a
    DataError naming the flag and the file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DataError(f"{flag} {path}: {e.strerror}") from None
    entries = [(lineno, line.strip()) for lineno, line in enumerate(lines, start=1)
               if line.strip() and not line.startswith("#")]
    if not entries:
        raise DataError(f"{flag} {path}: no {what} (one a line, '#' for comments)")
    return entries


def iter_jsonl(path, bad_rows: BadRows) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, object) for each non-blank line; other lines go to `bad_rows`.
    A `.gz` file is read decompressed (committed datasets are stored that way)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                bad_rows.report(path, lineno, f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(row, dict):
                bad_rows.report(path, lineno, f"expected a JSON object, got {type(row).__name__}")
                continue
            yield lineno, row


class DurableJsonlWriter:
    """Append-only jsonl file that a killed run can resume without duplicating or losing rows.

    Each row is one `write` of a full line followed by flush+fsync, so after a kill only the
    last line can be incomplete (it lacks its newline); opening the file cuts it off. An
    exclusive lock stops two runs (e.g. two shards given the same path) from interleaving.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise DataError(f"{self.path} is being written by another process") from None
        self.ids = self._repair_and_read_ids()

    def _repair_and_read_ids(self) -> set:
        self._file.seek(0)
        data = self._file.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning(
                "%s: cutting off an incomplete last line (%d bytes) left by an interrupted run",
                self.path,
                len(data) - end,
            )
            self._file.truncate(end)
            os.fsync(self._file.fileno())
        ids = set()
        for lineno, line in enumerate(data[:end].splitlines(), start=1):
            try:
                row_id = json.loads(line)["id"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(
                    f"{self.path}:{lineno}: corrupt row in existing output (not a JSON object with "
                    f"an 'id'); only a truncated last line can be repaired"
                ) from None
            if row_id in ids:
                raise DataError(f"{self.path}:{lineno}: duplicate id {row_id!r} in existing output")
            ids.add(row_id)
        return ids

    def write(self, row: dict) -> None:
        if row["id"] in self.ids:
            raise DataError(f"{self.path}: id {row['id']!r} is already written")
        self._file.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.ids.add(row["id"])

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""A fingerprint of the training data files, saved with every training checkpoint and compared
on resume: the resumed position (`consumed_samples`) indexes a shuffled order of these files'
rows, so a file that changed, appeared or went away under a run would silently resume at
another place in another stream. The change is refused, naming the file and what changed.
Files are compared by content in `data.train` order, so data moved to another directory
resumes."""

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks (checkpoint manifests use it too)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(files) -> list:
    """[{"file", "size", "sha256"}] in `files` order (a missing file is left to the dataset
    reader's error)."""
    return [{"file": str(f), "size": Path(f).stat().st_size, "sha256": file_sha256(Path(f))}
            for f in files if Path(f).is_file()]


def _describe(entry: dict) -> str:
    return f"{entry['file']} ({entry['size']} bytes, sha256 {entry['sha256'][:12]}...)"


def differences(saved: list, current: list) -> list:
    """What changed between two fingerprints, one phrase per data.train entry."""
    out = []
    for i in range(max(len(saved), len(current))):
        old = saved[i] if i < len(saved) else None
        new = current[i] if i < len(current) else None
        if old is None:
            out.append(f"data.train[{i}] {new['file']} was not in the data trained on")
        elif new is None:
            out.append(f"data.train[{i}] {old['file']} is no longer in data.train")
        elif old["sha256"] != new["sha256"]:
            out.append(f"data.train[{i}] {new['file']} changed (trained on {_describe(old)}, "
                       f"now {_describe(new)})")
    return out

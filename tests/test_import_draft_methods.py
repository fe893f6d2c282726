"""checkpoint_tools/import_draft.py goes through the registry's `import_hf` hook, so a DFlash
export imports from the command line as an EAGLE3 one does; a method without an HF import is
refused in one line naming the ones that have it."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _import_draft(*args):
    return subprocess.run([sys.executable, "checkpoint_tools/import_draft.py", *map(str, args)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)


def test_dflash_export_imports_from_the_command_line(tmp_path):
    import train_support as ts
    from megatron_specdec import registry
    from megatron_specdec.checkpointing import checkpoint
    from megatron_specdec.loading.conversion import convert_checkpoint
    from megatron_specdec.loading.hf_conversion import hf_to_megatron

    method = registry.get("dflash")
    hf_to_megatron(ts.make_tiny_model(tmp_path / "hf"), tmp_path / "base")
    convert_checkpoint(tmp_path / "base", tmp_path / "spec", "dflash",
                       {"block_size": 4, "target_layer_ids": [0, 1, 2]})
    export = method.export_hf(tmp_path / "spec", tmp_path / "export")
    proc = _import_draft("--method", "dflash", "--draft", export, "--model", tmp_path / "base",
                         "--out", tmp_path / "imported")
    assert proc.returncode == 0, proc.stderr[-2000:]
    draft = checkpoint.read_meta(tmp_path / "imported")["draft"]
    assert draft["algo"] == "dflash", draft
    again = method.export_hf(tmp_path / "imported", tmp_path / "again")
    assert (export / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()


def test_a_method_without_an_hf_import_is_refused(tmp_path):
    proc = _import_draft("--method", "ngram", "--draft", tmp_path, "--model", tmp_path,
                         "--out", tmp_path / "out")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --method ngram: has no HF import; expected one of:") and "dflash" in line, line
    proc = _import_draft("--method", "eagle9", "--draft", tmp_path, "--model", tmp_path,
                         "--out", tmp_path / "out")
    assert proc.returncode == 2 and "'eagle9'" in proc.stderr and "eagle3" in proc.stderr

"""bench/gpu_train.sh, the script a lent GPU trains a recipe with, in its CPU dry run: it
trains, brings back the log and exports the draft, so the script cannot rot between the rare
runs on a machine with a GPU."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_train_dry_run_exports_the_draft(tmp_path):
    out = tmp_path / "gpu_train"
    proc = subprocess.run(
        ["bash", "bench/gpu_train.sh", "--dry-run", "--recipe", "recipes/dflash_smollm2.yaml",
         "--out", str(out), "draft.config.anchors_per_sequence=8",
         "data.train=[data/smollm2_regen.jsonl.gz]"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHON": sys.executable,
             "HOME": str(tmp_path), "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r][-1] == 2, log
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"], config
    assert (out / "export" / "model.safetensors").stat().st_size > 0


def test_gpu_train_refuses_a_missing_recipe(tmp_path):
    proc = subprocess.run(["bash", "bench/gpu_train.sh", "--recipe", "recipes/none.yaml"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--recipe 'recipes/none.yaml' is not a file" in proc.stderr

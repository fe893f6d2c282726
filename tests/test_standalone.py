"""The repository stands alone: a copy of the tree with no ../shared beside it runs the demo's
data steps (list the prompt sources, regenerate answers, read MT-bench) from data/sources."""

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tree_files():
    """Tracked files and new files git does not ignore: what a clone of this commit holds."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=REPO, check=True, capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def _python(clone, *args):
    env = dict(os.environ, PYTHONPATH=str(clone))
    env.pop("SPECDEC_SHARED_DATA", None)
    done = subprocess.run([sys.executable, *args], cwd=clone, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, f"{' '.join(args[:3])} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def test_data_steps_run_in_a_bare_copy(tmp_path):
    clone = tmp_path / "clone"
    for f in _tree_files():
        (clone / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, clone / f)
    assert not (tmp_path / "shared").exists()

    where = _python(clone, "-c", "import megatron_specdec; print(megatron_specdec.__file__)")
    assert Path(where.strip()).is_relative_to(clone)  # the copy's code, not the checkout's
    demo_help = " ".join(_python(clone, "-m", "megatron_specdec.cli.demo", "--help").split())
    assert "(default: data/sources)" in demo_help, demo_help

    listing = _python(clone, "-m", "megatron_specdec.cli.data", "sources", "--data-dir", "data/sources")
    for line in ("gsm8k\ttrain\t7473 rows", "self_instruct_seed\ttrain\t175 rows",
                 "self_instruct_user\ttrain\t252 rows", "mt_bench\teval\t80 rows"):
        assert line in listing, listing

    # the demo's step 2, on the embedded model, with a tiny budget: new prompts beside the
    # committed data
    out, committed = clone / "runs" / "regen.jsonl", "data/smollm2_regen.jsonl.gz"
    _python(clone, "-m", "megatron_specdec.cli.data", "regenerate", "--data-dir", "data/sources",
            "--backend", "megatron", "--checkpoint", "default", "--limit", "2", "--batch-size", "2",
            "--max-new-tokens", "4", "--no-progress", "--out", str(out), "--exclude", committed)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["conversations"][-1]["role"] == "assistant" for r in rows)
    with gzip.open(clone / committed, "rt") as f:
        assert not {r["id"] for r in rows} & {json.loads(line)["id"] for line in f}

    # step 5's evaluation prompts and the shipped recipe's evaluation.prompts resolve in the copy
    questions = (clone / "data" / "sources" / "mt_bench.jsonl").read_text().splitlines()
    assert len(questions) == 80
    recipe = (clone / "recipes" / "eagle3_smollm2.yaml").read_text()
    assert "prompts: data/sources/mt_bench.jsonl" in recipe

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_specdec.data import DraftVocab
from megatron_specdec.cli.data import main

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO / "data" / "sources"


def test_help_lists_the_commands():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_specdec.cli.data", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert all(cmd in out for cmd in ("regenerate", "synthesize", "ground", "calibrate", "sources"))


def _conversations(path, n=4):
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"r{i}",
                    "conversations": [
                        {"role": "user", "content": f"Say {i}"},
                        {"role": "assistant", "content": f"I say {i} and {i + 1}."},
                    ],
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return path


def test_calibrate_writes_a_loadable_draft_vocab(tmp_path):
    data = _conversations(tmp_path / "c.jsonl")
    out = tmp_path / "d2t.safetensors"
    assert (
        main(
            [
                "calibrate",
                "--data",
                str(data),
                "--tokenizer",
                "default",
                "--draft-vocab-size",
                "16",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    vocab = DraftVocab.load(out)
    assert vocab.draft_vocab_size == 16 and vocab.vocab_size == 49152 and bool(vocab.t2d[2])
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["draft_vocab_size"]) == 16 and json.loads(meta["assistant_only"]) is True
    assert torch.equal(vocab.target_ids, vocab.t2d.nonzero().flatten())


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--draft-vocab-size", "0"], "--draft-vocab-size must be in"),
        (["--draft-vocab-size", "50000"], "--draft-vocab-size must be in"),
    ],
)
def test_calibrate_errors_name_the_flag(tmp_path, caplog, argv, message):
    data = _conversations(tmp_path / "c.jsonl")
    assert (
        main(["calibrate", "--data", str(data), "--out", str(tmp_path / "o.safetensors")] + argv)
        == 1
    )
    assert message in caplog.text


def test_calibrate_error_names_the_empty_file(tmp_path, caplog):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert (
        main(
            [
                "calibrate",
                "--data",
                str(empty),
                "--draft-vocab-size",
                "8",
                "--out",
                str(tmp_path / "o.safetensors"),
            ]
        )
        == 1
    )
    assert "no usable conversation rows" in caplog.text and str(empty) in caplog.text


def test_sources_and_regenerate_errors(tmp_path, caplog, capsys):
    assert main(["sources", "--data-dir", str(DATA_DIR)]) == 0
    listing = capsys.readouterr().out
    assert "gsm8k\ttrain\t7473 rows" in listing and "mt_bench\teval\t80 rows" in listing
    out = str(tmp_path / "o.jsonl")
    assert (
        main(["regenerate", "--out", out, "--backend", "openai", "--url", "http://127.0.0.1:9"])
        == 1
    )
    assert "--data-dir" in caplog.text
    assert (
        main(["regenerate", "--data-dir", str(DATA_DIR), "--out", out, "--backend", "openai"]) == 1
    )
    assert "needs --url and --model" in caplog.text
    assert (
        main(
            [
                "regenerate",
                "--sources",
                "mt_bench",
                "--data-dir",
                str(DATA_DIR),
                "--out",
                out,
                "--backend",
                "openai",
                "--url",
                "http://127.0.0.1:9",
                "--model",
                "m",
            ]
        )
        == 1
    )
    assert "evaluation-only" in caplog.text

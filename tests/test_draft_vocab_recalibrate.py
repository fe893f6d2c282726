"""checkpoint_tools/recalibrate_draft_vocab.py: a trained draft given the vocabulary of new
calibration data keeps its trained lm_head rows for tokens in both vocabularies, takes the
base's output rows for new ones, and stays an importable draft."""

import json
from pathlib import Path

import pytest
import torch

from megatron_specdec.data.jsonl import DataError
from megatron_specdec.methods.eagle3.hf_import import read_hf_draft
from megatron_specdec.methods.eagle3.vocab_recalibrate import base_output_rows, recalibrate, remap_rows

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "eagle3_smollm2"


def test_remap_keeps_known_rows_and_maps_base_rows_for_new_ones():
    old_targets = torch.tensor([1, 4, 7])
    old_rows = torch.tensor([[10.0, 1.0], [40.0, 4.0], [70.0, 7.0]])
    base = torch.stack([torch.arange(9.0) * -1.0, torch.arange(9.0) * 0.5], 1)  # trained rows: a linear map of the base rows
    rows = remap_rows(old_targets, old_rows, torch.tensor([0, 4, 7, 8]), base)
    assert torch.equal(rows[1:3], old_rows[1:])  # kept rows are copied exactly
    assert torch.allclose(rows[[0, 3]], torch.tensor([[0.0, 0.0], [80.0, 8.0]]), atol=1e-4)


def _calibration(path):
    rows = [{"id": f"c{i}", "conversations": [{"role": "user", "content": "Write a haiku about the sea."},
                               {"role": "assistant", "content": text}]}
            for i, text in enumerate(["Zymurgy quixotic fjords, zephyrs whisper.",
                         "Quixotic zymurgy: the fjords of Xanadu.",
                         "Waves fold on the shore."])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_recalibrated_draft_keeps_trained_rows(default_hf_dir, tmp_path):
    data = _calibration(tmp_path / "calib.jsonl")
    out = tmp_path / "draft"
    result = recalibrate(SHIPPED, default_hf_dir, [str(data)], out, draft_vocab_size=9000,
                         max_shard_mb=15)
    old_cfg, old = read_hf_draft(SHIPPED)
    cfg, new = read_hf_draft(out)
    assert cfg["draft_vocab_size"] == 9000 and new["lm_head.weight"].shape[0] == 9000
    old_targets = torch.arange(old["d2t"].numel()) + old["d2t"].long()
    new_targets = torch.arange(9000) + new["d2t"].long()
    assert torch.equal(new["t2d"].nonzero().flatten(), new_targets)
    assert result.kept + result.added == 9000
    assert 0.0 <= result.coverage_before <= result.coverage_after == 1.0  # 9000 ids hold every token seen
    base_rows = base_output_rows(default_hf_dir)
    for i, target in enumerate(new_targets.tolist()):
        hit = (old_targets == target).nonzero().flatten()
        if hit.numel():
            assert torch.equal(new["lm_head.weight"][i], old["lm_head.weight"][hit[0]]), (i, target)
    fit = torch.linalg.lstsq(base_rows[old_targets].double(), old["lm_head.weight"].double()).solution
    fresh = ~torch.isin(new_targets, old_targets)
    mapped = (base_rows[new_targets[fresh]].double() @ fit).to(torch.bfloat16)
    assert fresh.any() and torch.equal(new["lm_head.weight"][fresh], mapped)
    for name in old:
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(new[name], old[name]), name
    assert {k: v for k, v in cfg.items() if k != "draft_vocab_size"} == \
        {k: v for k, v in old_cfg.items() if k != "draft_vocab_size"}


def test_refusals_name_what_is_wrong(default_hf_dir, tmp_path):
    data = _calibration(tmp_path / "calib.jsonl")
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(Exception, match="taken"):
        recalibrate(SHIPPED, default_hf_dir, [str(data)], out)
    assert (out / "keep.txt").read_text() == "x"
    with pytest.raises(FileNotFoundError, match="config.json"):
        recalibrate(tmp_path, default_hf_dir, [str(data)], tmp_path / "new")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no usable conversation rows"):
        recalibrate(SHIPPED, default_hf_dir, [str(empty)], tmp_path / "new2")
    assert not (tmp_path / "new2").exists()

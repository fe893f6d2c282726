"""Training checkpoints and bad input through the trainer: a truncated, altered or
half-written checkpoint is refused with the reason and the previous good one is used (the
bad one kept aside); bad jsonl rows are reported with file and line, skipped or fatal as
configured; a run never overwrites what an output directory holds."""

import copy
import dataclasses
import shutil

import pytest

import train_support as ts
from megatron_specdec.checkpointing.checkpoint import CheckpointError
from megatron_specdec.training import checkpoints
from megatron_specdec.training.metrics import read_log

BAD_ROWS = [(3, "{not json"), (6, '{"id": "x", "text": "no conversations"}')]


@pytest.fixture(scope="module")
def trained(module_tmp):
    """A 4-step run (checkpoints at 2 and 4) on data with two bad rows."""
    root = module_tmp("train_ckpt")
    model = ts.make_tiny_model(root / "model")
    data = ts.write_conversations(root / "conv.jsonl", bad_lines=BAD_ROWS)
    out = root / "run"
    argv = ts.overrides(model, data, out, **{"optimizer.decay": "constant",
                                             "checkpointing.keep_last": 3})
    summary = ts.run(argv, log_file=root / "run.log")
    assert summary["steps"] == 4, summary
    return root, model, data, out, argv


def _copy(trained, tmp_path, step=4):
    out = trained[3]
    dst = tmp_path / f"step_{step:07d}"
    shutil.copytree(checkpoints.step_dir(out / "checkpoints", step), dst)
    return dst


def test_bad_rows_reported_with_file_and_line(trained):
    root, _, data, _, _ = trained
    text = (root / "run.log").read_text()
    assert f"{data}:3: invalid JSON" in text
    assert f"{data}:6: " in text


def test_bad_rows_fatal_when_configured(trained, tmp_path):
    _, model, data, _, _ = trained
    result = ts.run(ts.overrides(model, data, tmp_path / "fail", **{"data.on_error": "fail"}))
    assert result.startswith("error: DataError") and f"{data}:3" in result, result


def test_intact_checkpoint_verifies(trained, tmp_path):
    checkpoints.verify(_copy(trained, tmp_path))


@pytest.mark.parametrize("damage,reason", [
    ("truncate", "truncated or altered"),
    ("flip", r"corrupt \(sha256 mismatch\)"),
    ("no_manifest", "manifest.json is missing"),
    ("no_meta", "specdec_checkpoint.json is missing"),
])
def test_damaged_checkpoint_refused_with_reason(trained, tmp_path, damage, reason):
    path = _copy(trained, tmp_path)
    data_file = sorted(path.glob("*.distcp"))[0]
    if damage == "truncate":
        data_file.write_bytes(data_file.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(data_file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data_file.write_bytes(bytes(raw))
    elif damage == "no_manifest":
        (path / checkpoints.MANIFEST).unlink()
    else:
        (path / "specdec_checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match=reason):
        checkpoints.verify(path)


def test_corrupt_latest_falls_back_and_nothing_is_lost(trained):
    _, model, data, out, argv = trained
    before = {s: r["loss"] for s, r in read_log(out).items()}
    latest = checkpoints.step_dir(out / "checkpoints", 4)
    victim = sorted(latest.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:-100])
    summary = ts.run(argv + ["training.steps=6"], log_file=out.parent / "resume.log")
    assert summary["resumed_from"].endswith("step_0000002"), summary
    assert "refusing checkpoint" in (out.parent / "resume.log").read_text()
    assert "truncated or altered" in (out.parent / "resume.log").read_text()
    assert (out / "checkpoints" / "step_0000004.corrupt").is_dir()  # kept, not deleted
    after = read_log(out)
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4):  # recomputed from step 2's checkpoint: the same losses
        assert abs(after[step]["loss"] - before[step]) <= 1e-6, (step, after, before)
    assert (out / "recipe.yaml").is_file() and (out / "recipe.1.yaml").is_file()
    events = [line for line in (out / "train_log.jsonl").read_text().splitlines()
              if '"event": "resume"' in line]
    assert len(events) == 1
    checkpoints.verify(checkpoints.step_dir(out / "checkpoints", 6))


def test_no_resume_refuses_existing_checkpoints(trained):
    _, model, data, out, argv = trained
    listing = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    result = ts.run(argv + ["checkpointing.resume=false"])
    assert result.startswith("error: RecipeError") and "checkpointing.resume" in result, result
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == listing


def test_checkpoint_of_another_draft_refused_by_key(trained):
    from types import SimpleNamespace

    from megatron_specdec import registry
    from megatron_specdec.checkpointing.checkpoint import read_meta

    path = checkpoints.step_dir(trained[3] / "checkpoints", 2)
    meta = read_meta(path)
    saved = registry.config_from_dict(meta["training_checkpoint"]["draft"])
    hf = meta["hf_config"]
    model = SimpleNamespace(spec_config=saved, vocab_size=hf["vocab_size"],
                            config=SimpleNamespace(hidden_size=hf["hidden_size"],
                                                   num_layers=hf["num_hidden_layers"]))
    checkpoints.check_compatible(path, meta, model)
    # a key added to the config class since the checkpoint was written reads as its default
    added = next(f for f in dataclasses.fields(saved) if not f.metadata.get("resumable")
                 and f.default is not dataclasses.MISSING
                 and getattr(saved, f.name) == f.default)
    older = copy.deepcopy(meta)
    del older["training_checkpoint"]["draft"]["config"][added.name]
    checkpoints.check_compatible(path, older, model)
    other = not added.default if isinstance(added.default, bool) else 2 * added.default + 1
    setattr(saved, added.name, other)  # ...and a value other than the default is refused
    with pytest.raises(CheckpointError, match=added.name):
        checkpoints.check_compatible(path, older, model)
    setattr(saved, added.name, added.default)
    saved.ttt_steps += 1  # may change on resume
    checkpoints.check_compatible(path, meta, model)
    model.spec_config = registry.parse_config("eagle3", {"draft_vocab_size": 128},
                                          hf["num_hidden_layers"], hf["vocab_size"])
    with pytest.raises(CheckpointError, match="draft_vocab_size, padded_draft_vocab_size"):
        checkpoints.check_compatible(path, meta, model)


class _Payload:
    """Unpickling this creates `marker`: what an attacker's code would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _rewrite_manifest(path):
    """A forger would make the manifest match: only the pickle check may refuse."""
    import hashlib
    import json

    files = {str(f.relative_to(path)): {"size": f.stat().st_size,
                                        "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
             for f in sorted(path.rglob("*")) if f.is_file() and f.name != checkpoints.MANIFEST}
    (path / checkpoints.MANIFEST).write_text(json.dumps({"files": files}))


@pytest.mark.parametrize("where,reason", [
    (".metadata", r"\.metadata: its pickle refers to io\.open"),
    ("object", r"holds pickled objects \(rng_state/shard_0_1\)"),
    ("common.pt", r"common\.pt holds more than tensors .*it refers to io\.open"),
])
def test_pickle_payload_refused_without_running_it(trained, tmp_path, where, reason):
    import io
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    path = _copy(trained, tmp_path)
    marker = tmp_path / "payload_ran"
    payload = pickle.dumps(_Payload(marker))
    if where == ".metadata":
        (path / ".metadata").write_bytes(payload)
    elif where == "object":  # how format 1 stored RNG states: a pickled ShardedObject
        for f in path.glob("*.distcp"):
            f.unlink()
        dcp.save({"rng_state/shard_0_1": io.BytesIO(payload), "x": torch.zeros(2)},
                 checkpoint_id=str(path), no_dist=True)
    else:
        torch.save({"payload": _Payload(marker)}, path / "common.pt")
    _rewrite_manifest(path)
    with pytest.raises(CheckpointError, match=reason):
        checkpoints.verify(path)
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live: unpickled as torch/megatron would, it runs
    assert marker.exists()


def test_resume_over_another_base_refused_naming_it(trained, tmp_path):
    _, _, data, out, _ = trained
    other = ts.make_tiny_model(tmp_path / "other_model", seed=1)
    run = tmp_path / "run"
    shutil.copytree(out / "checkpoints", run / "checkpoints")
    result = ts.run(ts.overrides(other, data, run, **{"optimizer.decay": "constant"}))
    assert result.startswith("error: CheckpointError") and "another base model" in result, result
    assert "tensor embedding.word_embeddings.weight (sum|x| saved" in result, result


def test_base_fingerprint_names_config_and_dtype(trained):
    import copy

    from megatron_specdec.checkpointing.checkpoint import read_meta
    from megatron_specdec.training.base_fingerprint import differences

    saved = read_meta(checkpoints.step_dir(trained[3] / "checkpoints", 4))
    saved = saved["training_checkpoint"]["base"]
    assert differences(saved, saved) == []
    mine = copy.deepcopy(saved)
    mine["config"]["rms_norm_eps"] *= 2
    mine["dtype"] = "bfloat16"
    assert differences(saved, mine) == [
        f"config rms_norm_eps (saved {saved['config']['rms_norm_eps']!r}, "
        f"now {mine['config']['rms_norm_eps']!r})",
        "dtype (saved float32, now bfloat16)"]

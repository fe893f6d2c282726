"""A DFlash run in bf16 (fp32 master weights) stopped after step 5 and resumed from its step-4
checkpoint gives the losses of the uninterrupted run bitwise: the anchors are drawn from the
batch's token ids, the rest (masters, AdamW state, data position, RNG) is the trainer's.
Offline training (stored base states) gives online training's losses."""

import pytest

import train_support as ts

DFLASH = {"draft.algo": "dflash", "draft.config.block_size": 4,
          "draft.config.anchors_per_sequence": 4, "draft.config.target_layer_ids": "[0,1,2]",
          "model.dtype": "bfloat16", "optimizer.decay": "constant"}


def argv(model, data, out, steps, interval):
    base = [a for a in ts.overrides(model, data, out, **{"training.steps": steps,
                                                         "checkpointing.interval": interval})
            if not a.startswith("draft.config.")]
    return base + [f"{k}={v}" for k, v in DFLASH.items()]


@pytest.mark.slow  # three short runs; a bf16 stop and resume: test_train_precision (default)
def test_dflash_bf16_stop_and_resume_is_exact(tmp_path):
    model = ts.make_tiny_model(tmp_path / "model")
    data = ts.write_conversations(tmp_path / "conv.jsonl")
    whole = ts.run(argv(model, data, tmp_path / "whole", 6, 0))
    assert whole["steps"] == 6 and whole["algo"] == "dflash", whole
    args = argv(model, data, tmp_path / "resumed", 6, 2)
    assert ts.run(args, kill_after=5) == "killed"
    summary = ts.run(args)
    assert summary["resumed_from"].endswith("step_0000004"), summary
    want, got = ts.losses(tmp_path / "whole"), ts.losses(tmp_path / "resumed")
    assert len(got) == 6 and got == want, (got, want)
    assert want[0] != want[-1]  # it trains


@pytest.mark.slow  # two short runs; offline mode itself: test_train_runs (default)
def test_dflash_offline_matches_online(tmp_path):
    """Offline training (the base's states stored once, then replayed) gives online's losses:
    the loss reads only the stored aux states and the re-embedded anchors."""
    model = ts.make_tiny_model(tmp_path / "model")
    data = ts.write_conversations(tmp_path / "conv.jsonl")
    losses = {}
    for mode in ("online", "offline"):
        args = [a for a in argv(model, data, tmp_path / mode, 4, 0) if a != "model.dtype=bfloat16"]
        summary = ts.run(args + ["model.dtype=float32", f"training.mode={mode}"])
        assert summary["mode"] == mode and summary["steps"] == 4, summary
        losses[mode] = ts.losses(tmp_path / mode)
    assert len(losses["offline"]) == 4
    for a, b in zip(losses["offline"], losses["online"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), losses

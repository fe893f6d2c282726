"""Faults a long training run meets, each injected into a real run of the tiny model in its
own process, and what must hold after it: nothing committed before the fault is lost.

- SIGKILL while a checkpoint is written: the half-written one is refused, the previous one
  resumed, and the run ends bitwise equal to an uninterrupted one;
- the disk full (a file-size limit, RLIMIT_FSIZE) while a checkpoint is written: an error
  naming the checkpoint and the OS error, `latest` still names the previous checkpoint, and
  a resume from it ends bitwise equal; while the final model is exported: an error naming
  the checkpoint that holds it, no partial final/, and a rerun exports;
- SIGTERM: the step reached is checkpointed and the run returns normally; resumed, it ends
  bitwise equal;
- the data changed under a resumed run: refused, naming the file;
- one rank of a TP=2 run killed: the other stops within a bound with an error naming the
  failed collective, instead of waiting out the 30-minute process-group timeout.
Corrupt or truncated checkpoints are tests/test_train_checkpoints.py's, a regeneration
killed mid-file tests/test_data_regenerate.py's."""

import hashlib
import json
import multiprocessing as mp
import os
import resource
import signal
import time

import pytest

import train_support as ts
from megatron_specdec import distributed
from megatron_specdec.training import checkpoints

STEPS = 4
FSIZE_LIMIT = 64 * 1024  # above the run's log, below a checkpoint shard of the tiny draft


def _train(argv, fault, conn, rank=None, world=1, port=None):
    """Train `argv` in this (spawned) process with `fault` injected; sends the summary, or
    'error: <type>: <message>', to `conn`."""
    from megatron_specdec.training import load_recipe, train

    os.setpgrp()  # a group of its own: what it starts (a checkpoint Manager) ends with it
    if rank is not None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch

        torch.set_num_threads(1)
    on_step = None
    if fault == "sigkill_in_save":  # the step-4 shards are committed, its manifest is not
        table = checkpoints._file_table

        def killing_table(path):
            if path.name == checkpoints.step_dir("", STEPS).name:
                os.kill(os.getpid(), signal.SIGKILL)
            return table(path)

        checkpoints._file_table = killing_table
    elif fault == "fsize_after_3":
        def on_step(step):
            if step == 3:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a killed process
                resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))
    elif fault == "fsize_in_export":
        from megatron_specdec.training import trainer

        export = trainer.save_trained

        def limited_export(*args, **kwargs):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))
            return export(*args, **kwargs)

        trainer.save_trained = limited_export
    elif fault == "sigterm_at_3":
        def on_step(step):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
    elif fault == "rank1_killed_at_2":
        def on_step(step):
            if step == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    try:
        result = train(load_recipe(None, argv), on_step=on_step)
    except Exception as e:  # the test inspects the message
        result = f"error: {type(e).__name__}: {e}"
    finally:
        distributed.destroy()
    if rank in (None, 0):
        conn.send(result)


def _run(argv, fault=None, world=1, timeout=900):
    """(result or None if the process sent none, exit codes, seconds) of `_train`."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    port = distributed.free_port()
    ranks = [None] if world == 1 else list(range(world))
    procs = [ctx.Process(target=_train, args=(argv, fault, send, r, world, port))
             for r in ranks]
    start = time.time()
    for p in procs:
        p.start()
    send.close()
    try:
        result = recv.recv() if recv.poll(timeout) else None
    except EOFError:  # every sender died without a word
        result = None
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
        try:
            os.killpg(p.pid, signal.SIGKILL)  # what a killed process left running
        except ProcessLookupError:
            pass
    return result, [p.exitcode for p in procs], time.time() - start


def _digest(path, conn):
    """sha256 of every draft tensor of checkpoint `path` (read in its own process group)."""
    import torch

    from megatron_specdec.checkpointing import checkpoint

    tensors = checkpoint.load_plain_tensors(path, prefix="eagle3.")
    conn.send({k: hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
               for k, v in tensors.items()})
    distributed.destroy()


def draft_digest(path) -> dict:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_digest, args=(str(path), send))
    p.start()
    out = recv.recv()
    p.join()
    return out


@pytest.fixture(scope="module")
def setup(module_tmp):
    root = module_tmp("faults_train")
    model = ts.make_tiny_model(root / "model")
    data = ts.write_conversations(root / "conv.jsonl")
    return root, model, data


def _argv(setup, name, **extra):
    root, model, data = setup
    return ts.overrides(model, data, root / name, **dict({
        "optimizer.decay": "constant", "checkpointing.keep_last": 3}, **extra))


@pytest.fixture(scope="module")
def reference(setup):
    """An uninterrupted run: losses and the step-4 checkpoint's draft."""
    argv = _argv(setup, "reference")
    summary, codes, _ = _run(argv)
    assert isinstance(summary, dict) and summary["steps"] == STEPS, summary
    out = setup[0] / "reference"
    return ts.losses(out), draft_digest(checkpoints.step_dir(out / "checkpoints", STEPS))


def _resume_matches(setup, name, reference):
    """Rerun the command of run `name` (resume) and compare with the reference bitwise."""
    summary, codes, _ = _run(_argv(setup, name))
    assert isinstance(summary, dict) and summary["steps"] == STEPS, summary
    out = setup[0] / name
    assert ts.losses(out) == reference[0]
    assert draft_digest(checkpoints.step_dir(out / "checkpoints", STEPS)) == reference[1]
    return summary


def test_sigkill_during_checkpoint_write_resumes_previous_bitwise(setup, reference):
    result, codes, _ = _run(_argv(setup, "sigkill_save"), "sigkill_in_save")
    assert result is None and codes == [-signal.SIGKILL], (result, codes)
    ckpt = setup[0] / "sigkill_save" / "checkpoints"
    assert (ckpt / checkpoints.LATEST).read_text().strip() == "step_0000002"
    with pytest.raises(Exception, match="manifest.json is missing"):
        checkpoints.verify(checkpoints.step_dir(ckpt, STEPS))
    summary = _resume_matches(setup, "sigkill_save", reference)
    assert summary["resumed_from"].endswith("step_0000002")
    assert (ckpt / "step_0000004.corrupt").is_dir()  # kept aside, not deleted


def test_disk_full_during_checkpoint_write_keeps_latest(setup, reference):
    result, codes, _ = _run(_argv(setup, "disk_full"), "fsize_after_3")
    assert isinstance(result, str) and result.startswith("error: CheckpointError"), result
    assert "step_0000004" in result and "File too large" in result, result
    assert f"a file-size limit of {FSIZE_LIMIT} bytes" in result, result
    assert "latest still names step_0000002" in result, result
    ckpt = setup[0] / "disk_full" / "checkpoints"
    assert (ckpt / checkpoints.LATEST).read_text().strip() == "step_0000002"
    checkpoints.verify(checkpoints.step_dir(ckpt, 2))
    summary = _resume_matches(setup, "disk_full", reference)
    assert summary["resumed_from"].endswith("step_0000002")


@pytest.mark.slow  # a second disk-full fault: test_disk_full_during_checkpoint_write_keeps_latest
def test_disk_full_during_final_export_names_the_checkpoint(setup, reference):
    result, codes, _ = _run(_argv(setup, "export_full"), "fsize_in_export")
    assert isinstance(result, str) and "writing the trained model to" in result, result
    assert f"a file-size limit of {FSIZE_LIMIT} bytes" in result and "step 4" in result, result
    out = setup[0] / "export_full"
    assert not (out / "final").exists()  # nothing half-written under the final name
    checkpoints.verify(checkpoints.step_dir(out / "checkpoints", STEPS))
    summary, _, _ = _run(_argv(setup, "export_full"))  # the rerun only exports
    assert summary["steps_this_run"] == 0 and (out / "final").is_dir(), summary


def test_sigterm_checkpoints_the_step_and_exits_cleanly(setup, reference):
    result, codes, _ = _run(_argv(setup, "sigterm"), "sigterm_at_3")
    assert codes == [0] and isinstance(result, dict), (result, codes)
    assert result["stopped"] == "sigterm" and result["steps"] == 3, result
    ckpt = setup[0] / "sigterm" / "checkpoints"
    checkpoints.verify(checkpoints.step_dir(ckpt, 3))
    assert (ckpt / checkpoints.LATEST).read_text().strip() == "step_0000003"
    summary = _resume_matches(setup, "sigterm", reference)
    assert summary["resumed_from"].endswith("step_0000003")


def test_changed_data_refused_naming_the_file(setup, reference, tmp_path):
    import shutil

    root, model, _ = setup
    data = tmp_path / "conv.jsonl"
    shutil.copy(root / "conv.jsonl", data)
    out = tmp_path / "run"
    shutil.copytree(root / "reference" / "checkpoints", out / "checkpoints")
    with open(data, "a") as f:
        f.write(json.dumps(ts.conversation(99)) + "\n")
    argv = ts.overrides(model, data, out, **{"training.steps": STEPS + 2})
    result, _, _ = _run(argv)
    assert isinstance(result, str) and "was trained on other data" in result, result
    assert f"data.train[0] {data} changed" in result, result


def test_tp2_rank_killed_other_stops_with_clear_error(setup):
    argv = _argv(setup, "tp2_kill", **{"parallelism.tp": 2})
    result, codes, seconds = _run(argv, "rank1_killed_at_2", world=2, timeout=300)
    assert codes[1] == -signal.SIGKILL, codes
    assert isinstance(result, str) and "a collective failed after step 2" in result, result
    assert seconds < 300, seconds

"""`checkpoint.commit_dir`: the path always names a complete version (a reader polling it
while versions are committed never finds it missing; the rename-aside commit this replaced
failed 98 such polls in one run of this loop), old versions are removed, a directory written
before links were used is replaced, and a user's own link is replaced without touching its
target. `atomic_output`, the one way exports write a directory, commits whole or not at
all."""

import os
import threading

import pytest

from megatron_specdec.checkpointing import checkpoint


def _version(parent, name, text):
    tmp = checkpoint.atomic_dir(parent / name)
    (tmp / "v").write_text(text)
    return tmp


def test_reader_never_sees_a_gap(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.commit_dir(_version(tmp_path, "ckpt", "0"), path)
    misses, reads, done = [], [0], threading.Event()

    def reader():
        while not done.is_set():
            try:
                os.lstat(path)
                reads[0] += 1
            except OSError as e:
                misses.append(repr(e))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(1, 300):
            checkpoint.commit_dir(_version(tmp_path, "ckpt", str(i)), path)
    finally:
        done.set()
        thread.join()
    assert not misses, (len(misses), misses[:3])
    assert reads[0] > 0
    assert (path / "v").read_text() == "299"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt", path.resolve().name])  # one live version, nothing left over


def test_legacy_directory_replaced_and_removed(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "v").write_text("old")
    checkpoint.commit_dir(_version(tmp_path, "ckpt", "new"), path)
    assert path.is_symlink() and (path / "v").read_text() == "new"
    checkpoint.remove_dir(path)
    assert list(tmp_path.iterdir()) == []


def test_users_link_replaced_but_its_target_kept(tmp_path):
    elsewhere = tmp_path / "other_disk" / "ckpt"
    elsewhere.mkdir(parents=True)
    (elsewhere / "v").write_text("user's")
    path = tmp_path / "out" / "ckpt"
    path.parent.mkdir()
    path.symlink_to(elsewhere)
    checkpoint.commit_dir(_version(path.parent, "ckpt", "new"), path)
    assert (path / "v").read_text() == "new"
    assert (elsewhere / "v").read_text() == "user's"
    checkpoint.remove_dir(path)
    assert not path.exists() and (elsewhere / "v").read_text() == "user's"


def test_atomic_output_commits_whole_or_leaves_the_old_directory(tmp_path):
    out = tmp_path / "export"
    with checkpoint.atomic_output(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert out.is_dir() and not out.is_symlink() and (out / "config.json").read_text() == "{}"
    with pytest.raises(RuntimeError, match="half written"):
        with checkpoint.atomic_output(out) as tmp:
            (tmp / "weights.bin").write_text("partial")
            raise RuntimeError("half written")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"], "a temporary directory was left behind"

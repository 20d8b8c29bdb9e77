"""What the snapshot store trusts on disk: private directories only, files created 0600 with
O_EXCL|O_NOFOLLOW, planted symlinks never followed, other users' files never read or written."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from lightning_ft.checkpoint import SnapshotError, SnapshotStore
from lightning_ft.checkpoint.memory.files import snapshot_file_problem
from lightning_ft.checkpoint.memory.roots import SNAPSHOT_DIRS, default_root, ensure_writable_root
from lightning_ft.private_dirs import private_dir_problem

NOBODY = 65534
ME = os.getuid()


@pytest.mark.parametrize("mode, uid, problem", [
    (stat.S_IFDIR | 0o700, ME, None),
    (stat.S_IFDIR | 0o755, ME, None),
    (stat.S_IFDIR | 0o775, ME, "writable by its group"),
    (stat.S_IFDIR | 0o1777, ME, "writable by its group and other users"),
    (stat.S_IFDIR | 0o757, ME, "writable by other users"),
    (stat.S_IFDIR | 0o700, NOBODY, f"owned by uid {NOBODY}"),
    (stat.S_IFLNK | 0o777, ME, "symbolic link"),
    (stat.S_IFREG | 0o600, ME, "not a directory"),
])
def test_private_dir_problem(mode, uid, problem):
    found = private_dir_problem(mode, uid, ME, SNAPSHOT_DIRS)
    if problem is None:
        assert found is None
    else:
        assert problem in found[0] and found[1]


def _stat(mode: int, uid: int = ME, nlink: int = 1) -> os.stat_result:
    return os.stat_result((mode, 1, 1, nlink, uid, 0, 100, 0, 0, 0))


@pytest.mark.parametrize("st, for_write, problem", [
    (_stat(stat.S_IFREG | 0o600), True, None),
    (_stat(stat.S_IFLNK | 0o777), False, "symbolic link"),
    (_stat(stat.S_IFIFO | 0o600), False, "not a regular file"),
    (_stat(stat.S_IFREG | 0o600, uid=NOBODY), False, f"owned by uid {NOBODY}"),
    (_stat(stat.S_IFREG | 0o600, nlink=2), True, "2 hard links"),
    (_stat(stat.S_IFREG | 0o600, nlink=2), False, None),
])
def test_snapshot_file_problem(st, for_write, problem):
    found = snapshot_file_problem(st, ME, for_write)
    assert (found is None) if problem is None else (problem in found)


def test_the_default_root_is_per_user_and_created_private(tmp_path, monkeypatch):
    assert default_root().endswith(f"lightning_ft-{ME}")
    root = tmp_path / "parent" / "root"
    old = os.umask(0)
    try:
        ensure_writable_root(str(root))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700


@pytest.mark.parametrize("where", ["root", "run", "rank"])
def test_a_directory_of_another_user_is_refused_with_owner_mode_and_fix(tmp_path, where):
    root = tmp_path / "shm"
    target = {"root": root, "run": root / "job", "rank": root / "job" / "rank0"}[where]
    target.mkdir(parents=True, mode=0o700)
    os.chown(target, NOBODY, NOBODY)
    with pytest.raises(ValueError) as err:
        SnapshotStore(root=root, run_id="job", rank=0)
    message = str(err.value)
    assert str(target) in message and f"owned by uid {NOBODY}" in message and "drwx------" in message
    assert "another local user" in message and "Remove it" in message


def test_a_group_writable_or_symlinked_directory_is_refused(tmp_path):
    root = tmp_path / "shm"
    (root / "job").mkdir(parents=True, mode=0o700)
    os.chmod(root / "job", 0o770)
    with pytest.raises(ValueError, match=r"writable by its group.*0770.*chmod go-w"):
        SnapshotStore(root=root, run_id="job", rank=0)
    os.chmod(root / "job", 0o700)
    SnapshotStore(root=root, run_id="job", rank=0)  # fixed as the message says
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, tmp_path / "link")
    with pytest.raises(ValueError, match="symbolic link"):
        SnapshotStore(root=tmp_path / "link", run_id="job", rank=0)
    os.chmod(root, 0o1777)  # a shared root like /dev/shm itself is not a root of ours
    with pytest.raises(ValueError, match="writable by its group and other users"):
        SnapshotStore(root=root, run_id="job", rank=0)


def test_a_run_directory_taken_over_after_the_store_was_created_stops_saves_and_is_not_read(tmp_path, caplog):
    store = SnapshotStore(root=tmp_path / "shm", run_id="job", rank=0)
    os.mkdir(store.run_dir, 0o700)
    os.chown(store.run_dir, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=f"owned by uid {NOBODY}"):
        store.save({"w": torch.ones(2)}, step=1)
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        assert store.readable_steps(include_peers=True) == []
    assert any("not read" in r.message for r in caplog.records)


def test_every_file_is_created_0600_without_a_later_chmod(tmp_path, monkeypatch):
    def no_chmod(*args, **kwargs):
        raise AssertionError("files must get their mode at creation")

    old = os.umask(0)  # the mode comes from the open() call itself, not from the umask
    monkeypatch.setattr(os, "chmod", no_chmod)
    try:
        store = SnapshotStore(root=tmp_path / "shm", run_id="modes", rank=0, keep_last=2)
        store.preallocate(1 << 16)
        spare = store._writer.spare
        assert stat.S_IMODE(os.lstat(spare).st_mode) == 0o600
        infos = [store.save({"w": torch.full((100,), float(s))}, step=s) for s in (1, 2, 3)]  # spare, fresh, recycled
        receiver = SnapshotStore(root=tmp_path / "other", run_id="modes", rank=1)
        received = receiver.write_bytes(store.read_bytes(infos[-1]))
    finally:
        os.umask(old)
    for path in [i.path for i in store.list()] + [received.path]:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, path
    for directory in (store.run_dir, store.rank_dir, receiver.rank_dir):
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700


@pytest.fixture
def victim(tmp_path):
    """A file of the same user outside the snapshot root that a planted link points at."""
    path = tmp_path / "config.yaml"
    path.write_text("lr: 0.1\n")
    return path


def test_a_symlink_named_like_a_snapshot_is_never_followed(tmp_path, victim, caplog):
    store = SnapshotStore(root=tmp_path / "shm", run_id="links", rank=0, keep_last=2)
    store.save({"w": torch.ones(10)}, step=1)
    store.save({"w": torch.ones(10) * 2}, step=2)
    older = store.list()[-1]
    os.unlink(older.path)
    os.symlink(victim, older.path)  # where the next save would recycle
    newer = os.path.join(store.rank_dir, f"step-{99:012d}.snap")
    other = SnapshotStore(root=tmp_path / "elsewhere", run_id="links", rank=0)
    os.symlink(other.save({"w": torch.zeros(10)}, step=99).path, newer)  # a "newer" snapshot to resume

    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        assert [i.step for i in store.list()] == [2]
        assert store.latest().step == 2 and store.readable_steps(include_peers=True) == [2]
        for step in (3, 4, 5):
            store.save({"w": torch.ones(10) * step}, step=step)
    assert victim.read_text() == "lr: 0.1\n"
    assert sum("symbolic link" in r.message for r in caplog.records) == 2  # each planted link reported once
    assert [i.step for i in store.list()] == [5, 4]
    with pytest.raises(SnapshotError, match="symbolic link"):
        store.load(store.list()[0].__class__(99, 0, "links", newer, 0, 0.0))


def test_a_symlink_swapped_in_after_listing_is_not_written_through(tmp_path, victim, monkeypatch, caplog):
    store = SnapshotStore(root=tmp_path / "shm", run_id="race", rank=0, keep_last=2)
    for step in (1, 2):
        store.save({"w": torch.ones(10) * step}, step=step)
    listed = store._listing.files  # what save() lists its directory with

    def list_then_swap(directory, rank):  # the entry turns into a link between the listing and the rename
        infos = listed(directory, rank)
        oldest = infos[-1].path
        os.unlink(oldest)
        os.symlink(victim, oldest)
        return infos

    monkeypatch.setattr(store._listing, "files", list_then_swap)
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        info = store.save({"w": torch.full((10,), 7.0)}, step=3)
    monkeypatch.undo()
    assert victim.read_text() == "lr: 0.1\n"
    assert any("not reusing the recycled file" in r.message for r in caplog.records)
    assert torch.equal(store.load(info)["w"], torch.full((10,), 7.0))


def test_a_planted_spare_path_is_replaced_not_followed(tmp_path, victim, caplog):
    store = SnapshotStore(root=tmp_path / "shm", run_id="spare", rank=0)
    os.makedirs(store.rank_dir, mode=0o700)
    os.symlink(victim, store._writer.spare_path())
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        store.preallocate(1 << 16)
    assert victim.read_text() == "lr: 0.1\n"
    assert not os.path.islink(store._writer.spare) and stat.S_IMODE(os.lstat(store._writer.spare).st_mode) == 0o600
    assert store.save({"w": torch.ones(3)}, step=1).step == 1
    # a spare of ours turned into a link later is not reused either
    store.preallocate(1 << 16)
    os.unlink(store._writer.spare)
    os.symlink(victim, store._writer.spare)
    store.preallocate(1 << 16)
    assert victim.read_text() == "lr: 0.1\n" and not os.path.islink(store._writer.spare)


def test_a_hard_linked_snapshot_file_is_not_recycled(tmp_path):
    store = SnapshotStore(root=tmp_path / "shm", run_id="hard", rank=0, keep_last=2)
    first = store.save({"w": torch.ones(10)}, step=1)
    store.save({"w": torch.ones(10)}, step=2)
    outside = tmp_path / "linked-elsewhere"
    os.link(first.path, outside)
    before = outside.read_bytes()
    store.save({"w": torch.zeros(10)}, step=3)
    assert outside.read_bytes() == before  # written into a fresh file instead


def test_peer_directories_of_the_same_user_are_read_others_are_skipped(tmp_path, caplog):
    peer = SnapshotStore(root=tmp_path / "shm", run_id="peers", rank=1)
    peer.save({"w": torch.ones(3)}, step=4)
    me = SnapshotStore(root=tmp_path / "shm", run_id="peers", rank=0)
    assert me.readable_steps(include_peers=True) == [4]  # same user, same host: still works
    os.chmod(peer.rank_dir, 0o777)
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        assert me.readable_steps(include_peers=True) == []
    assert any("writable by its group and other users" in r.message for r in caplog.records)
    os.chmod(peer.rank_dir, 0o700)
    os.chown(peer.list()[0].path, NOBODY, NOBODY)
    assert me.readable_steps(include_peers=True) == []

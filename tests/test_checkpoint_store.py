"""SnapshotStore: round trip, crash consistency, pruning, scoping, raw-bytes transfer."""

from __future__ import annotations

import collections
import logging
import os
import time

import pytest
import torch

from lightning_ft.checkpoint import SnapshotError, SnapshotStore
from lightning_ft.checkpoint.memory import copying
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.roots import configured_run_id, resolve_root, resolve_run_id

from ckpt_helpers import tensors_equal

Point = collections.namedtuple("Point", "x y")


def nested_state() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "f32": torch.randn(3, 5),
        "f64": torch.randn(7, dtype=torch.float64),
        "bf16": torch.randn(9, dtype=torch.bfloat16),
        "f16": torch.randn(2, 3, dtype=torch.float16),
        "i8": torch.tensor([-3, 4, 127], dtype=torch.int8),
        "i64": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, dtype=torch.complex64),
        "transposed": base.t(),
        "strided": base[:, ::2],
        "scalar": torch.tensor(2.5),
        "int_scalar": torch.tensor(7),
        "empty": torch.empty(0, 4),
        "param": torch.nn.Parameter(torch.ones(3)),
        "nested": {"list": [torch.zeros(2), 1, "two", None], "tuple": (torch.ones(1), 3.0)},
        "ordered": collections.OrderedDict(a=1, b=[1, 2]),
        "point": Point(torch.tensor([1.0]), "y"),
        "python": {"epoch": 3, "name": "run", "lr": 1e-3, "flags": {1, 2}, "counts": collections.Counter(a=2),
                   "bytes": b"\x00\xff", "complex": 1 + 2j, "inf": float("inf")},
    }


@pytest.fixture
def store(tmp_path):
    with SnapshotStore(root=tmp_path, run_id="unit", rank=0, keep_last=2) as s:
        yield s


def test_round_trip_equals_original_and_is_a_copy(store):
    state = nested_state()
    shared = torch.randn(4)
    state["alias_a"] = shared
    state["alias_b"] = shared
    with torch.serialization.safe_globals([Point]):  # a user type: allowed the way torch.load wants it
        store.save(state, step=5)
        loaded = store.load()

    assert loaded.keys() == state.keys()
    for key in state:
        assert tensors_equal(loaded[key], state[key]), key
    assert loaded["transposed"].shape == (6, 4) and loaded["strided"].shape == (4, 3)
    assert loaded["scalar"].dim() == 0 and loaded["bf16"].dtype == torch.bfloat16
    assert isinstance(loaded["param"], torch.nn.Parameter)
    assert isinstance(loaded["ordered"], collections.OrderedDict) and isinstance(loaded["point"], Point)
    assert loaded["alias_a"] is loaded["alias_b"]  # identity preserved within one snapshot
    # a copy: neither side sees the other's later writes
    loaded["f32"].add_(1)
    state["i64"].add_(100)
    assert not torch.equal(loaded["f32"], state["f32"])
    with torch.serialization.safe_globals([Point]):
        assert torch.equal(store.load()["i64"], torch.arange(5))


def test_snapshot_is_taken_at_save_time(store):
    weights = torch.zeros(1000)
    store.save({"w": weights}, step=1)
    weights.fill_(9)  # what dump_checkpoint returns is live; later training must not leak in
    assert torch.count_nonzero(store.load()["w"]) == 0


def _corrupt(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("damage", ["truncate", "flip_data", "flip_meta", "flip_header", "empty"])
def test_torn_or_corrupt_snapshot_is_skipped(store, damage, caplog):
    store.save({"w": torch.randn(300_000), "n": 1}, step=1)
    newest = store.save({"w": torch.randn(300_000), "n": 2}, step=2)
    with open(newest.path, "rb") as f:
        header = fmt.Header.unpack(f.read(fmt.HEADER_SIZE))
    if damage == "truncate":
        os.truncate(newest.path, newest.nbytes - 4096)
    elif damage == "flip_data":
        _corrupt(newest.path, header.data_off + 777_777)
    elif damage == "flip_meta":
        _corrupt(newest.path, header.meta_off + 5)
    elif damage == "flip_header":
        _corrupt(newest.path, 20)
    else:
        os.truncate(newest.path, 0)

    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        latest = store.latest()
    assert latest is not None and latest.step == 1
    assert store.load(latest)["n"] == 1
    assert any("skipping snapshot" in r.message and newest.path in r.message for r in caplog.records)
    assert store.verify(newest) is not None
    with pytest.raises(SnapshotError):
        store.load(newest)
    assert store.readable_steps() == [1]


@pytest.mark.parametrize("pipeline_min", [0, 1 << 62])  # helper thread following the copy / one pass after it
def test_the_sums_that_follow_the_copy_equal_a_pass_after_it(store, monkeypatch, pipeline_min):
    monkeypatch.setattr(copying, "PIPELINE_MIN_BYTES", pipeline_min)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the helper runs only then
    monkeypatch.setattr(copying, "_PIECE_BYTES", 3 << 18)  # 768 KiB: pieces end inside blocks
    base = torch.randn(1200, 700)
    state = {"big": torch.randn(1 << 20), "odd": torch.randn(5), "t": base.t(), "half": torch.randn(777_777).half(),
             "ints": torch.arange(300_001), "bool": torch.rand(99) > 0.5, "empty": torch.empty(0),
             "tail": torch.ones(3)}
    enc = fmt.encode(state)
    assert enc.data_len % fmt.BLOCK_SIZE  # the last block is partial
    got = torch.randint(0, 255, (enc.data_len,), dtype=torch.uint8)  # a recycled file's old bytes
    reference = got.clone()
    sums = copying.copy_and_sum(enc, got)
    copying.copy_tensors(enc, reference)  # the same bytes; alignment gaps keep the old content
    assert torch.equal(got, reference)
    assert torch.equal(sums, fmt.block_sums(reference))
    # and through the store: saved, recycled, verified, loaded
    for step in (1, 2, 3):
        state["odd"] += 1
        info = store.save(state, step)
    assert store.verify(info) is None
    assert tensors_equal(store.load(info), state)


def test_an_interrupted_save_returns_only_after_the_sums_helper_stopped_reading(monkeypatch):
    # found by review: a KeyboardInterrupt while waiting for the helper left it reading a map
    # the caller unmaps right after (a segfault); the exception must wait for the helper
    import mmap
    import signal
    import threading
    import time

    monkeypatch.setattr(copying, "PIPELINE_MIN_BYTES", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    real = fmt.block_sums
    helper_done = threading.Event()

    def lagging(data, block_size=fmt.BLOCK_SIZE):  # the helper's last (partial) block, late
        if threading.current_thread().name != "lightning_ft-block-sums":
            return real(data, block_size)
        time.sleep(1.0)
        try:
            return real(data, block_size)
        finally:
            helper_done.set()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(copying, "block_sums", lagging)
    previous = signal.signal(signal.SIGUSR2, interrupt)
    enc = fmt.encode({"w": torch.randn((4 << 20) // 4 + 16)})  # 4 MiB + 64 B: the last block is partial
    mm = mmap.mmap(-1, enc.file_size)
    data = fmt.frombuffer_u8(mm, enc.data_off, enc.data_len)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR2))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            copying.copy_and_sum(enc, data)
        assert helper_done.is_set()  # it read its last block before the exception reached us
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR2, previous)
    del data
    mm.close()


def _pieces(blob: bytes, size: int) -> list[bytes]:
    return [blob[i:i + size] for i in range(0, len(blob), size)]


@pytest.mark.parametrize("numel", [0, 5, (1 << 18) + 6, 3 << 18])  # no data, < 1 block, 1 block + 24 B, 3 blocks
def test_a_snapshot_arriving_in_pieces_is_verified_like_a_whole_one(store, numel):
    info = store.save({"w": torch.randn(numel), "n": 1}, step=1)
    with open(info.path, "rb") as f:
        blob = f.read(info.nbytes)
    header = fmt.verify(blob, len(blob))
    for size in (1, 7, 4096, 1 << 20, (1 << 20) + 8, 3 << 20, len(blob)):
        assert fmt.verify_chunks(_pieces(blob, size), len(blob)) == header
    damaged = {"flip in the last block": header.data_off + 4 * numel - 1 if numel else None,
               "flip in the first block": header.data_off + 3 if numel else None,
               "flip in the metadata": header.meta_off + 2, "flip in the header": 30}
    for what, offset in damaged.items():
        if offset is None:
            continue
        bad = bytearray(blob)
        bad[offset] ^= 0x04
        for size in (4096, 3 << 20):
            with pytest.raises(SnapshotError):
                fmt.verify_chunks(_pieces(bytes(bad), size), len(blob))
                pytest.fail(what)
    with pytest.raises(SnapshotError, match="torn/truncated"):
        fmt.verify_chunks(_pieces(blob[:-8] if numel else blob[:100], 4096), len(blob))
    with pytest.raises(SnapshotError, match="longer than the expected"):
        fmt.verify_chunks(_pieces(blob + b"\0" * 8, 4096), len(blob))
    with pytest.raises(SnapshotError, match="torn/truncated"):
        fmt.verify_chunks(_pieces(blob, 4096), len(blob) + 8)


def test_leftover_temp_file_is_ignored_and_cleaned(tmp_path):
    store = SnapshotStore(root=tmp_path, run_id="unit", rank=0)
    store.save({"w": torch.ones(10)}, step=3)
    good_bytes = open(store.list()[0].path, "rb").read()
    dead_pid = 2**22 + 12345  # above pid_max on default Linux, so never alive
    temp = os.path.join(store.rank_dir, f".tmp-step-{9:012d}-{dead_pid}-abcdef01.snap")
    with open(temp, "wb") as f:
        f.write(good_bytes)  # even a complete-looking temp file is not committed
    assert [i.step for i in store.list()] == [3]
    assert store.latest().step == 3
    SnapshotStore(root=tmp_path, run_id="unit", rank=0)  # a new incarnation cleans up
    assert not os.path.exists(temp)


def test_keep_last_prunes_oldest_and_recycles_files(tmp_path):
    store = SnapshotStore(root=tmp_path, run_id="unit", rank=0, keep_last=2)
    inodes = {}
    for step in (10, 20, 30, 40):
        info = store.save({"w": torch.full((50_000,), float(step))}, step=step)
        inodes[step] = os.stat(info.path).st_ino
    assert [i.step for i in store.list()] == [40, 30]
    assert inodes[30] == inodes[10] and inodes[40] == inodes[20]  # oldest file rewritten in place
    assert torch.equal(store.load(store.list()[1])["w"], torch.full((50_000,), 30.0))
    # a smaller state in a recycled (larger) file is still exact; the file is never shrunk, so a
    # reader that still maps it cannot fault past its end
    small = store.save({"w": torch.arange(7)}, step=50)
    assert os.path.getsize(small.path) > small.nbytes
    assert torch.equal(store.load()["w"], torch.arange(7))
    assert [i.step for i in store.list()] == [50, 40]
    blob = store.read_bytes(store.latest())
    assert len(blob) == small.nbytes  # the slack is not part of the snapshot
    other = SnapshotStore(root=tmp_path / "other-host", run_id="unit", rank=0)
    assert torch.equal(other.load(other.write_bytes(blob))["w"], torch.arange(7))
    store.close()


def test_bytes_to_send_are_the_verified_file_and_a_file_changed_after_its_check_is_checked_again(tmp_path):
    """The sender's view of a snapshot (a private map, no copy) holds exactly what read_bytes
    gives, also for a recycled file with slack; a file written after it was verified (its
    ctime moves) is verified again, so the remembered check never vouches for other bytes."""
    store = SnapshotStore(root=tmp_path / "a", run_id="unit", rank=0, keep_last=2)
    store.save({"w": torch.full((50_000,), 1.0)}, step=10)
    store.save({"w": torch.full((50_000,), 2.0)}, step=20)
    small = store.save({"w": torch.arange(7)}, step=30)  # recycles step 10's larger file
    assert os.path.getsize(small.path) > small.nbytes
    assert store.readable_steps() == [20, 30]  # verified once here ...
    with store.bytes_to_send(store.find(30)) as view:  # ... and not summed again here
        assert view.dtype == torch.uint8 and bytes(view.numpy()) == store.read_bytes(small)
    other = SnapshotStore(root=tmp_path / "b", run_id="unit", rank=0)
    with store.bytes_to_send(small) as view:
        assert torch.equal(other.load(other.write_bytes(view.numpy().data))["w"], torch.arange(7))
    # flip one byte of the data region in place, keeping the file's times: its ctime still moves
    header = fmt.Header.unpack(open(small.path, "rb").read(fmt.HEADER_SIZE))
    before = os.stat(small.path)
    with open(small.path, "r+b") as f:
        f.seek(header.data_off)
        byte = f.read(1)
        f.seek(header.data_off)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(small.path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert store.verify(small) is not None
    with pytest.raises(SnapshotError), store.bytes_to_send(small):
        pass
    store.close()


def test_keep_last_one_never_leaves_zero_snapshots(tmp_path):
    store = SnapshotStore(root=tmp_path, run_id="unit", rank=0, keep_last=1)
    store.save({"a": torch.ones(3)}, step=1)
    first = store.list()[0]
    store.save({"a": torch.zeros(3)}, step=2)
    assert [i.step for i in store.list()] == [2]
    assert not os.path.exists(first.path)
    store.save({"a": torch.full((3,), 5.0)}, step=2)  # same step again replaces it
    assert torch.equal(store.load()["a"], torch.full((3,), 5.0))


def test_discard_newer_than(tmp_path):
    store = SnapshotStore(root=tmp_path, run_id="unit", rank=0, keep_last=5)
    for step in (1, 2, 3):
        store.save({"s": step}, step=step)
    assert sorted(store.discard_newer_than(1)) == [2, 3]
    assert [i.step for i in store.list()] == [1]


def test_run_id_scoping(tmp_path, monkeypatch):
    a = SnapshotStore(root=tmp_path, run_id="job-a", rank=0)
    b = SnapshotStore(root=tmp_path, run_id="job-b", rank=0)
    a.save({"who": "a"}, step=7)
    assert b.latest() is None and b.readable_steps(include_peers=True) == []
    b.save({"who": "b"}, step=3)
    assert a.load()["who"] == "a" and b.load()["who"] == "b"
    # rank directories of the same run are separate, but peers' steps are visible on request
    a1 = SnapshotStore(root=tmp_path, run_id="job-a", rank=1)
    assert a1.latest() is None
    assert a1.readable_steps(include_peers=True) == [7]
    assert a1.find(7, include_peers=True).rank == 0

    for var in ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LIGHTNING_FT_SNAPSHOT_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_run_id() == "default" and configured_run_id() is None  # written there, never resumed
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's placeholder without --rdzv-id
    assert configured_run_id() is None
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert resolve_run_id() == "4242" == configured_run_id()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "te")
    assert resolve_run_id() == "te"
    monkeypatch.setenv("LIGHTNING_FT_RUN_ID", "mine/../x")
    assert resolve_run_id() == "mine_.._x"  # never escapes the root
    with pytest.raises(ValueError, match="contradictory settings: run_id='explicit' but LIGHTNING_FT_RUN_ID"):
        resolve_run_id("explicit")  # one resolver for every entry point: a contradiction is an error
    monkeypatch.delenv("LIGHTNING_FT_RUN_ID")
    assert resolve_run_id("explicit") == "explicit"
    monkeypatch.setenv("LIGHTNING_FT_RUN_ID", "mine/../x")
    monkeypatch.setenv("LIGHTNING_FT_SNAPSHOT_DIR", str(tmp_path / "env-root"))
    assert resolve_root() == str(tmp_path / "env-root")
    assert SnapshotStore(rank=0).run_dir == str(tmp_path / "env-root" / "mine_.._x")


def test_raw_bytes_transfer(tmp_path):
    src = SnapshotStore(root=tmp_path / "host-a", run_id="r", rank=0)
    dst = SnapshotStore(root=tmp_path / "host-b", run_id="r", rank=1)
    state = {"w": torch.randn(1000), "step": 12}
    blob = src.read_bytes(src.save(state, step=12))
    info = dst.write_bytes(blob)
    assert (info.step, info.rank) == (12, 1)
    assert tensors_equal(dst.load(), state)
    damaged = bytearray(blob)
    damaged[-3] ^= 1
    with pytest.raises(SnapshotError):
        dst.write_bytes(damaged)
    with pytest.raises(SnapshotError):
        dst.write_bytes(blob[: len(blob) // 2])
    assert [i.step for i in dst.list()] == [12] and not any(n.startswith(".tmp") for n in os.listdir(dst.rank_dir))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        SnapshotStore(root=tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="rank"):
        SnapshotStore(root=tmp_path, rank=-1)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="root="):
        SnapshotStore(root=blocker / "sub", rank=0)


def test_preallocated_spare_is_used_by_the_next_fresh_write(tmp_path):
    store = SnapshotStore(root=tmp_path, run_id="spare", rank=0, keep_last=2)
    assert store.spare_needed()
    store.preallocate(64 * 1024)
    assert not store.spare_needed()
    spares = [n for n in os.listdir(store.rank_dir) if n.startswith(".tmp-spare-")]
    assert len(spares) == 1
    spare_inode = os.stat(os.path.join(store.rank_dir, spares[0])).st_ino
    info = store.save({"w": torch.arange(100)}, step=1)  # a different size than preallocated: still exact
    assert os.stat(info.path).st_ino == spare_inode
    assert not any(n.startswith(".tmp-") for n in os.listdir(store.rank_dir))
    assert torch.equal(store.load()["w"], torch.arange(100))
    assert store.spare_needed()  # one snapshot, keep_last=2: the next save cannot recycle yet
    store.save({"w": torch.ones(3)}, step=2)
    assert not store.spare_needed()  # now the oldest gets recycled
    store.close()


def test_keep_last_one_turns_the_replaced_snapshot_into_the_spare(tmp_path):
    store = SnapshotStore(root=tmp_path, run_id="spare1", rank=0, keep_last=1)
    first = store.save({"w": torch.zeros(1000)}, step=1)
    inode = os.stat(first.path).st_ino
    store.save({"w": torch.ones(1000)}, step=2)
    assert not store.spare_needed()
    third = store.save({"w": torch.full((1000,), 3.0)}, step=3)
    assert os.stat(third.path).st_ino == inode  # the first file came back as the write target
    assert [i.step for i in store.list()] == [3] and torch.equal(store.load()["w"], torch.full((1000,), 3.0))
    store.discard_spare()
    assert not any(n.startswith(".tmp-") for n in os.listdir(store.rank_dir))


def test_spare_of_a_dead_process_is_cleaned_up(tmp_path):
    store = SnapshotStore(root=tmp_path, run_id="spare2", rank=0)
    store.save({"w": 1}, step=1)
    stale = os.path.join(store.rank_dir, f".tmp-spare-{2**22 + 777}.snap")
    open(stale, "wb").close()
    SnapshotStore(root=tmp_path, run_id="spare2", rank=0)
    assert not os.path.exists(stale)


def test_maps_of_files_replaced_by_another_writer_are_released(tmp_path):
    store = SnapshotStore(root=tmp_path, run_id="maps", rank=0, keep_last=2)
    for step in (1, 2):
        store.save({"w": torch.ones(1000) * step}, step=step)
    assert len(store._writer.maps) == 2
    other = SnapshotStore(root=tmp_path, run_id="maps", rank=0, keep_last=2)
    other.write_bytes(other.read_bytes(other.list()[0]))  # replaces step 2's file with a new inode
    store.save({"w": torch.zeros(1000)}, step=3)
    assert len(store._writer.maps) == 1  # only step 3 (recycled step 1); the replaced inode's map was dropped
    assert [i.step for i in store.list()] == [3, 2] and torch.equal(store.load()["w"], torch.zeros(1000))
    store.close()


def test_full_shm_fails_cleanly_and_keeps_older_snapshots(tmp_path, monkeypatch):
    import errno

    store = SnapshotStore(root=tmp_path, run_id="full", rank=0, keep_last=3)
    store.save({"w": torch.ones(10)}, step=1)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match="No space"):
        store.save({"w": torch.zeros(10)}, step=2)
    assert [i.step for i in store.list()] == [1] and not any(n.startswith(".tmp") for n in os.listdir(store.rank_dir))
    assert torch.equal(store.load()["w"], torch.ones(10))


def _deferred_state() -> dict:
    return {"weight": torch.randn(64, 64), "exp_avg": torch.randn(1 << 16), "buffer": torch.zeros(4), "step": 3}


def _is_big(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 4


@pytest.fixture
def small_states_in_background(monkeypatch):
    """Copy even these small test states on the helper thread (as large ones are)."""
    monkeypatch.setattr(copying, "BACKGROUND_MIN_BYTES", 0)


def test_a_small_state_is_copied_at_once_and_still_committed_by_commit_pending(store):
    state = _deferred_state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    start = time.perf_counter()
    store.save_in_background(state, 5, _is_big)
    state["weight"].add_(1)  # below BACKGROUND_MIN_BYTES: copied before the call returned
    time.sleep(0.2)  # training goes on before the commit: not part of the save's work
    assert store.pending_copy_done() and tensors_equal(store.load(store.commit_pending()), expected)
    elapsed = time.perf_counter() - start
    assert store.last_timing.work == store.last_timing.blocked <= elapsed - 0.2


@pytest.mark.usefixtures("small_states_in_background")
def test_a_background_save_holds_the_state_of_its_call_and_is_committed_by_the_next_change(store):
    state = _deferred_state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    store.save_in_background(state, 5, _is_big)
    assert store.pending_step == 5 and [i.step for i in store.list()] == []  # invisible until committed
    state["buffer"].add_(1)  # copied before save_in_background returned
    info = store.commit_pending()
    assert info.step == 5 and store.pending_step is None and store.commit_pending() is None
    assert tensors_equal(store.load(info), expected)
    # any other change to the store commits a pending snapshot first
    store.save_in_background(state, 6, _is_big)
    store.save(state, 7)
    assert [i.step for i in store.list()] == [7, 6]
    store.save_in_background(state, 8, _is_big)
    store.close()
    assert [i.step for i in store.list()] == [8, 7]


@pytest.mark.usefixtures("small_states_in_background")
def test_a_deferred_tensor_changed_before_the_commit_abandons_the_snapshot(store, caplog):
    state = _deferred_state()
    store.save(state, 1)
    store.save_in_background(state, 2, _is_big)
    state["weight"].mul_(1.0)  # same values, but an in-place change the copy may have raced
    with pytest.raises(SnapshotError, match=r"step 2 abandoned: 1 of the tensors .*shapes 64x64"):
        store.commit_pending()
    assert [i.step for i in store.list()] == [1]
    assert not [n for n in os.listdir(store.rank_dir) if n.startswith(".tmp-step")]
    # the same through an implicit commit: logged, and the new save goes on
    store.save_in_background(state, 3, _is_big)
    state["exp_avg"].add_(1)
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        store.save(state, 4)
    assert "background snapshot of step 3 abandoned before a new snapshot" in caplog.text
    assert [i.step for i in store.list()] == [4, 1]


def test_a_copy_for_another_rank_is_kept_in_its_directory_and_an_abandoned_one_is_discarded(tmp_path):
    """Sharded state: a holder keeps rank 1's snapshot in rank 1's directory (refused when the
    blob holds another rank's state); after a resume at step 10, copies newer than it in other
    ranks' directories are removed, this rank's own are not (its resume removes those)."""
    source = SnapshotStore(root=tmp_path / "host-b", run_id="unit", rank=1)
    blobs = {step: source.read_bytes(source.save({"w": torch.full((4,), float(step))}, step=step))
             for step in (10, 20)}
    holder_own = SnapshotStore(root=tmp_path / "host-a", run_id="unit", rank=0)
    holder_own.save({"w": torch.zeros(4)}, step=20)
    with SnapshotStore(root=tmp_path / "host-a", run_id="unit", rank=1) as copies:
        for blob in blobs.values():
            copies.write_bytes(blob, taken_by=1)
        with pytest.raises(SnapshotError, match="holds rank 1's state, not rank 0's"):
            copies.write_bytes(blobs[10], taken_by=0)
        assert [i.step for i in copies.list()] == [20, 10]
    assert holder_own.discard_newer_in_other_rank_dirs(10) == [(1, 20)]
    assert [i.step for i in holder_own.list(1)] == [10] and [i.step for i in holder_own.list()] == [20]
    source.close()
    holder_own.close()

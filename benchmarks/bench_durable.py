"""Durable tier: time training is blocked per checkpoint, time to durable, compute slowdown while persisting.

For a checkpoint of ``size`` MiB (parameters + two Adam moments as CPU float32 tensors), one
process, one rank, everything in the same run (ratios are the result; this 2-core machine is
shared, absolute times mean little):

* blocked per checkpoint (median of ``--repeats``, steady state):
    ours      ``SnapshotStore.save`` into /dev/shm (the oldest file recycled) + ``DurablePersister.offer``;
              also while the previous snapshot's upload is in flight (superseded, never queued)
    sync      ``TorchCheckpointIO.save_checkpoint`` to a directory on /work's disk: what Lightning's
              ``ModelCheckpoint`` runs at every save (``trainer.save_checkpoint`` after ``dump_checkpoint``)
    async     ``AsyncCheckpointIO(TorchCheckpointIO()).save_checkpoint``: returns after cloning the tensors
              (each save waits for the previous one before the clock starts)
    dcp       ``torch.distributed.checkpoint.async_save`` (no process group, its default thread
              executor) to a directory on /work's disk: returns after staging a copy of the tensors
* in a training loop (an MLP whose parameters are a third of the state, Adam, batch 16; a
  checkpoint every ``LOOP_EVERY`` steps after a step's optimizer update, as the callback does):
  blocked = the time the training thread spends in the checkpoint's calls; cost = the wall time
  of the ``LOOP_EVERY`` steps from the checkpoint on minus as many steps without one (what the
  checkpoint's background work slows training by, on top of the blocked time):
    ours, background  ``save_in_background`` (parameters and optimizer state copied on a helper
              thread) + the commit in an optimizer step pre-hook (waits for what is left of the
              copy) + ``offer``: what ``EmergencyCheckpoint`` does for a periodic snapshot
    ours, sync        ``SnapshotStore.save`` + ``offer`` (the emergency path)
    async / sync      ``AsyncCheckpointIO`` / ``TorchCheckpointIO`` as above
  with torch on one thread (the second core free for background work) and on two (none free);
* time to durable: from the save call until the step's manifest is written in a directory on
  /work's disk (memory save + upload + fsync + size check + marker + manifest) vs a
  raw sequential write of the same number of bytes from memory with ``fsync``
  (``dd conv=fsync``-style), each checkpoint paired with a raw write; unbounded (as the SIGTERM
  flush runs) and at the bound paced periodic copies start at; also the upload
  alone (time to durable minus the memory save);
* compute while persisting: a fixed single-threaded matmul loop alone vs while an upload of a
  committed snapshot is in flight, at each bandwidth bound of ``--bounds``; anchors: ``dd`` in
  another process (the disk at full speed), a thread copying memory (no disk), an A/A control;
  the memory save is the blocked time above and is not part of this window;
* pacing in a training loop: the MLP above (batch 4) with a snapshot and a durable copy every
  so many steps that a copy at the starting bound takes a third of the interval, paced as by default;
  the bound after each of the pacer's verdicts and the slowdown of steps during uploads over
  the run's second half (``--pacing-uploads``);
* CPU of one upload, machine-wide: direct I/O (ours) vs through the page cache; what a checksum
  pass over the shard would cost (CRC-32, the previous design) vs the snapshot's own
  verification (header CRC + block sums), which is paid only when a shard is read back or
  downloaded.

Usage: ``.venv/bin/python benchmarks/bench_durable.py [--sizes 100,1024] [--repeats 5] [--bounds 64,512,0]
[--pacing-uploads 8] [--no-write]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_ft.checkpoint.durable.persister import DurablePersister
from lightning_ft.checkpoint.durable.settings import DEFAULT_MAX_MIB_PER_SECOND
from lightning_ft.checkpoint.durable.targets import LocalDirTarget
from lightning_ft.checkpoint.durable.tier import DurableTier
from lightning_ft.checkpoint.lightning.background import changed_only_by_optimizer_steps
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.roots import default_root
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.pacing import PACING_START_BYTES_PER_SECOND, UploadPacer

HERE = Path(__file__).resolve().parent
LOOP_EVERY = 4  # training-loop section: a checkpoint every so many steps
SECTION = "## Durable tier (issue 12)"
MiB = 1 << 20


def make_state(size_mib: int) -> dict:
    numel = size_mib * MiB // 3 // 4
    params = {f"w{i}": torch.randn(numel // 4) for i in range(4)}
    moments = [{"exp_avg": torch.randn(numel // 4), "exp_avg_sq": torch.rand(numel // 4), "step": torch.tensor(1.0)}
               for _ in range(4)]
    return {"state_dict": params, "optimizer_states": [{"state": dict(enumerate(moments)), "param_groups": []}],
            "global_step": 0}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_write_fsync(path: Path, nbytes: int) -> float:
    block = os.urandom(MiB) * 4
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(len(block), left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def compute_loop(iterations: int = 16) -> float:
    """A fixed amount of single-threaded compute: the same 256x256 matmul and tanh each time (no
    chaining, so the values never drift into denormals and every call does the same work)."""
    a, w = torch.randn(256, 256), torch.randn(256, 256) / 16
    out = torch.empty(256, 256)
    start = time.perf_counter()
    for _ in range(iterations):
        torch.tanh(torch.mm(a, w, out=out), out=out)
    return time.perf_counter() - start


def dcp_async_blocked(state: dict, directory: Path, repeats: int) -> float:
    """Median time ``dcp.async_save`` blocks the caller (each save waits for the previous one first)."""
    import torch.distributed.checkpoint as dcp

    # DCP wants string keys all the way down
    flat = {"state_dict": state["state_dict"],
            "optimizer": {str(k): v for k, v in state["optimizer_states"][0]["state"].items()}}
    blocked = []
    for i in range(repeats):
        start = time.perf_counter()
        future = dcp.async_save(flat, checkpoint_id=str(directory / f"s{i % 2}"))
        blocked.append(time.perf_counter() - start)
        future.result()
    return statistics.median(blocked)


def machine_cpu_seconds() -> float:
    """CPU time used so far by the whole machine (every state but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def upload_cpu_seconds(tier: DurableTier, info, timeline: str) -> float:
    """Machine-wide CPU seconds of one upload at the tier's bandwidth bound (write-back included: it
    waits for fsync)."""
    os.sync()
    before = machine_cpu_seconds()
    tier.upload(info, timeline, 1)
    used = machine_cpu_seconds() - before
    tier.target.delete("bench")
    return used


def checksum_cpu_seconds(path: str) -> tuple[float, float]:
    """CPU seconds (this process) of a CRC-32 pass over the file (what the upload paid before it
    took the shard's checksum from the snapshot header) and of the snapshot's own verification."""
    with open(path, "rb") as f:
        data = f.read()
    start = time.process_time()
    zlib.crc32(data)
    crc = time.process_time() - start
    start = time.process_time()
    fmt.verify(data, len(data))
    return crc, time.process_time() - start


class LoopModel:
    """An MLP whose parameters are a third of ``size_mib`` (Adam's two moments are the rest)."""

    def __init__(self, size_mib: int, batch: int = 16) -> None:
        width = 1024 if size_mib < 512 else 2048
        layers = max(1, size_mib * MiB // 3 // 4 // (width * width))
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.batch = torch.randn(batch, width)
        self.step = 0
        self.train_step()  # the optimizer state exists from here on

    def train_step(self) -> None:
        self.model(self.batch).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1

    def checkpoint(self) -> dict:
        return {"state_dict": self.model.state_dict(), "optimizer_states": [self.optimizer.state_dict()],
                "global_step": self.step}


def loop_costs(size_mib: int, repeats: int, scratch: Path, threads: int) -> dict:
    """Blocked time and cost per checkpoint inside a training loop (see the module docstring)."""
    torch.set_num_threads(threads)
    loop = LoopModel(size_mib)
    shm_root = Path(default_root()) / f"bench-loop-{os.getpid()}"
    store = SnapshotStore(shm_root, run_id="bench", rank=0, keep_last=2)
    tier = DurableTier(LocalDirTarget(str(scratch / "loop-durable"), direct_io=True), "bench", keep_last=2,
                       max_bytes_per_second=DEFAULT_MAX_MIB_PER_SECOND * MiB)
    persister = DurablePersister(tier, lambda: store, rank=0)
    disk = scratch / "loop-ckpt"
    disk.mkdir(exist_ok=True)
    sync_io, async_io = TorchCheckpointIO(), AsyncCheckpointIO(TorchCheckpointIO())
    blocked_in_commit = [0.0]

    def commit(*_: object) -> None:
        if store.pending_step is not None:
            start = time.perf_counter()
            persister.offer(store.commit_pending(), "bench", 1)
            blocked_in_commit[0] += time.perf_counter() - start

    hook = loop.optimizer.register_step_pre_hook(commit)

    def ours_background() -> None:
        deferred = changed_only_by_optimizer_steps([loop.optimizer])
        store.save_in_background(loop.checkpoint(), loop.step, deferred)

    contenders = {
        "ours_bg": ours_background,
        "ours_sync": lambda: persister.offer(store.save(loop.checkpoint(), loop.step), "bench", 1),
        "async": lambda: async_io.save_checkpoint(loop.checkpoint(), disk / f"async{loop.step % 2}.ckpt"),
        "sync": lambda: sync_io.save_checkpoint(loop.checkpoint(), disk / "sync.ckpt"),
    }
    result: dict = {"size_mib": size_mib, "threads": threads}
    try:
        for _ in range(2):  # warm-up: snapshot files to recycle exist, as in steady state
            contenders["ours_sync"]()
            loop.train_step()
        persister.wait_idle(600)
        plain: list[float] = []
        samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in contenders}
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(LOOP_EVERY):
                loop.train_step()
            plain.append(time.perf_counter() - start)
            for name, save in contenders.items():
                blocked_in_commit[0] = 0.0
                start = time.perf_counter()
                save()
                blocked = time.perf_counter() - start
                for _ in range(LOOP_EVERY):
                    loop.train_step()
                window = time.perf_counter() - start
                samples[name][0].append(blocked + blocked_in_commit[0])
                samples[name][1].append(window)
                # the next contender starts from idle: no upload or write of this one still running
                commit()
                persister.wait_idle(600)
                async_io.teardown()
        baseline = statistics.median(plain)
        result["step"] = baseline / LOOP_EVERY
        for name, (blocked, windows) in samples.items():
            result[f"{name}_blocked"] = statistics.median(blocked)
            result[f"{name}_cost"] = statistics.median(windows) - baseline
    finally:
        hook.remove()
        commit()
        persister.wait_idle(600)
        async_io.teardown()
        store.close()
        shutil.rmtree(shm_root, ignore_errors=True)
        torch.set_num_threads(1)
    return result


def pacing_loop(size_mib: int, scratch: Path, uploads: int) -> dict:
    """A training loop (torch on one thread, batch 4) with a snapshot and a durable copy every
    so many steps that a copy at the starting bound takes about a third of the interval, ``uploads``
    times, paced as ``EmergencyCheckpoint`` paces by default (budget 2 %, start 64 MiB/s, at
    most the default bound): the pacer's verdicts, and the slowdown of the steps an upload ran
    through against the steps no upload touched over the run's second half, measured here by the
    same rule but independently of the pacer."""
    torch.set_num_threads(1)
    loop = LoopModel(size_mib, batch=4)
    start = time.perf_counter()
    for _ in range(5):
        loop.train_step()
    step_seconds = (time.perf_counter() - start) / 5
    every = max(20, round(3 * size_mib / 64 / step_seconds))
    steps = every * uploads
    shm_root = Path(default_root()) / f"bench-pacing-{os.getpid()}"
    store = SnapshotStore(shm_root, run_id="bench", rank=0, keep_last=2)
    tier = DurableTier(LocalDirTarget(str(scratch / "pacing-durable"), direct_io=True), "bench", keep_last=2)
    verdicts: list[dict] = []
    persister = DurablePersister(tier, lambda: store, rank=0, pacer=UploadPacer(DEFAULT_MAX_MIB_PER_SECOND * MiB),
                                 emit=lambda event, **fields: event == "durable_pacing" and verdicts.append(fields))
    busy: list[float] = []
    idle: list[float] = []
    try:
        for i in range(steps):
            if i % every == 0:
                persister.offer(store.save(loop.checkpoint(), loop.step), "bench", 1)
            mark = persister.activity()
            start = time.perf_counter()
            loop.train_step()
            seconds = time.perf_counter() - start
            persister.observe_step(seconds, mark)
            if i >= steps // 2 and persister.activity() == mark:
                (busy if mark[0] else idle).append(seconds)
    finally:
        persister.wait_idle(600)
        store.close()
        shutil.rmtree(shm_root, ignore_errors=True)
    slowdown = statistics.median(busy) / statistics.median(idle) - 1 if busy and idle else None
    return {"size_mib": size_mib, "every": every, "steps": steps, "step": statistics.median(idle or busy),
            "uploads": uploads, "rates": [v["mib_per_second"] for v in verdicts],
            "slowdowns": [v["slowdown"] for v in verdicts], "slowdown": slowdown, "busy": len(busy), "idle": len(idle)}


def args_windows(size_mib: int) -> int:
    """Windows to sample per kind (each followed by as long alone)."""
    return 4 if size_mib >= 512 else 20


def slowdown_window(kind, tier: DurableTier, info, timeline: str, scratch: Path) -> tuple[float | None, float]:
    """(median compute loop during ``kind`` / median alone right after - 1, the window's seconds).

    ``kind``: a bandwidth bound in MiB/s (0: unbounded) for our upload on a thread; "dd": the
    same file copied by ``dd oflag=direct conv=fsync`` in another process; "memcpy": a thread
    copying 4 MiB buffers at the default bound's rate; "sleep": a thread sleeping 1 s.
    """
    if isinstance(kind, (int, float)):
        tier.max_bytes_per_second = kind * MiB or None
        work = threading.Thread(target=tier.upload, args=(info, timeline, 1), daemon=True)
    elif kind == "dd":
        work = subprocess.Popen(["dd", f"if={info.path}", f"of={scratch / 'dd.bin'}", "bs=4M", "oflag=direct",
                                 "conv=fsync", "status=none"])
    elif kind == "memcpy":
        def copy() -> None:
            src = torch.empty(4 * MiB, dtype=torch.uint8)
            dst = torch.empty_like(src)
            start, done = time.monotonic(), 0
            while done < info.nbytes:
                dst.copy_(src)
                done += src.numel()
                ahead = done / (DEFAULT_MAX_MIB_PER_SECOND * MiB) - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
        work = threading.Thread(target=copy, daemon=True)
    else:
        work = threading.Thread(target=time.sleep, args=(1.0,), daemon=True)
    start = time.monotonic()
    if isinstance(work, threading.Thread):
        work.start()
    alive = work.is_alive if isinstance(work, threading.Thread) else (lambda: work.poll() is None)
    during = []
    while alive():
        during.append(compute_loop())
    took = time.monotonic() - start
    work.join() if isinstance(work, threading.Thread) else work.wait()
    tier.target.delete("bench")  # the timing parts above are done; keep the disk free
    during = during[:-1]  # the last loop may have run past the window's end
    if not during:
        return None, took
    alone = [compute_loop() for _ in range(len(during))]
    return statistics.median(during) / statistics.median(alone) - 1, took


def run_size(size_mib: int, repeats: int, scratch: Path, bounds: list[float]) -> dict:
    state = make_state(size_mib)
    shm_root = Path(default_root()) / f"bench-durable-{os.getpid()}"
    store = SnapshotStore(shm_root, run_id="bench", rank=0, keep_last=2)
    tier = DurableTier(LocalDirTarget(str(scratch / "durable"), direct_io=True), "bench", keep_last=2,
                       max_bytes_per_second=None)
    persister = DurablePersister(tier, lambda: store, rank=0)
    result: dict = {"size_mib": size_mib}
    try:
        step = 0

        def save_and_offer() -> None:
            nonlocal step
            step += 1
            state["global_step"] = step
            info = store.save(state, step)
            persister.offer(info, "bench", 1)

        # warm-up: files to recycle exist (steady state of periodic snapshots)
        for _ in range(2):
            save_and_offer()
            persister.wait_idle(600)
        def to_durable() -> tuple[float, float]:
            """(blocked, seconds from the save call until the manifest was written) of one checkpoint."""
            start = time.monotonic()
            save_and_offer()
            blocked = time.monotonic() - start
            persister.wait_idle(600)
            published = tier.last_published
            assert published is not None and published[0] == step, "the step did not become durable"
            return blocked, published[1] - start  # the manifest was written (retention runs after)

        # each checkpoint right before a raw write of as many bytes: a pair sees the same disk
        # (this VM's fsync time drifts by 2x within minutes), and the ratio is taken per pair
        ours, durable, raw, ratios = [], [], [], []
        for _ in range(repeats):
            blocked, seconds = to_durable()
            raw.append(raw_write_fsync(scratch / "raw.bin", store.list()[0].nbytes))
            ours.append(blocked)
            durable.append(seconds)
            ratios.append(seconds / raw[-1])
        result["ours_blocked"] = statistics.median(ours)
        result["to_durable"] = statistics.median(durable)
        result["raw_fsync"] = statistics.median(raw)
        result["to_durable_ratio"] = statistics.median(ratios)
        result["upload_mib_s"] = (persister.measured_bytes_per_second or 0) / MiB
        # periodic copies run paced (so the training is not starved), from this bound on
        tier.max_bytes_per_second = PACING_START_BYTES_PER_SECOND
        result["to_durable_bounded"] = statistics.median(to_durable()[1] for _ in range(min(repeats, 3)))
        tier.max_bytes_per_second = None
        # a new snapshot never waits for an upload in flight: save + offer while the previous
        # step's upload runs (the offer supersedes; the file being uploaded is held, so this
        # save cannot recycle it)
        busy = []
        for _ in range(repeats):
            save_and_offer()
            time.sleep(0.01)
            assert not persister.idle(), "the upload ended before the next save"
            start = time.monotonic()
            save_and_offer()
            busy.append(time.monotonic() - start)
            persister.wait_idle(600)
        result["ours_blocked_busy"] = statistics.median(busy)

        disk = scratch / "ckpt"
        disk.mkdir()
        sync_io = TorchCheckpointIO()
        result["sync_blocked"] = statistics.median(
            timed(lambda: sync_io.save_checkpoint(state, disk / "sync.ckpt")) for _ in range(repeats))
        async_io = AsyncCheckpointIO(TorchCheckpointIO())
        blocked = []
        for i in range(repeats):
            blocked.append(timed(lambda i=i: async_io.save_checkpoint(state, disk / f"async{i % 2}.ckpt")))
            async_io.teardown()  # waits for the save: the next one starts from idle
        result["async_blocked"] = statistics.median(blocked)
        result["dcp_blocked"] = dcp_async_blocked(state, disk / "dcp", repeats)

        # compute alone vs while one upload is in flight (the memory save is the blocked time above,
        # so it is not counted twice here), at each bandwidth bound in turn, window by window (the
        # machine drifts): the committed snapshot is uploaded again under fresh timeline names while
        # the training thread runs compute loops; after each window as many loops run alone.
        # Anchors: the same bytes copied by `dd oflag=direct` in another process (this disk at full
        # speed, not our code), a thread copying memory at the default bound's rate (memory traffic
        # alone, no disk), and a thread that only sleeps (A/A control).
        info = store.save(state, step + 1)
        store.hold(info.step)
        kinds = [*bounds, "dd", "memcpy", "sleep"]
        slowdown: dict = {kind: [] for kind in kinds}
        seconds: dict = {kind: [] for kind in kinds}
        for window in range(args_windows(size_mib)):
            for kind in kinds:
                ratio, took = slowdown_window(kind, tier, info, f"overhead{window}", scratch)
                if ratio is not None:
                    slowdown[kind].append(ratio)
                    seconds[kind].append(took)
        result["slowdown"] = {kind: statistics.median(v) for kind, v in slowdown.items() if v}
        result["slowdown_seconds"] = {kind: statistics.median(v) for kind, v in seconds.items() if v}
        result["windows"] = len(slowdown["sleep"])
        tier.max_bytes_per_second = DEFAULT_MAX_MIB_PER_SECOND * MiB
        # CPU time of one upload, whole machine (/proc/stat: every thread and the kernel's
        # write-back), direct I/O (ours) against the same upload through the page cache
        result["upload_cpu"] = upload_cpu_seconds(tier, info, "cpu-direct")
        tier.target.direct_io = False
        result["upload_cpu_buffered"] = upload_cpu_seconds(tier, info, "cpu-buffered")
        tier.target.direct_io = True
        result["crc_cpu"], result["verify_cpu"] = checksum_cpu_seconds(info.path)
    finally:
        persister.wait_idle(600)
        store.close()
        shutil.rmtree(shm_root, ignore_errors=True)
    return result


def render(results: list[dict], load: tuple[float, float]) -> str:
    full = [r for r in results if "ours_blocked" in r]  # not with --only-loop
    lines = [SECTION, "",
             "`python benchmarks/bench_durable.py` (one process, one rank; checkpoint = parameters + two Adam",
             "moments as CPU float32; durable target and Lightning's files on /work's disk; median of the",
             f"repeats; load average {load[0]:.1f} before, {load[1]:.1f} after; 2 shared cores).", "",
             "Time training is blocked per checkpoint:", "",
             "| state | ours (memory save + offer) | ours, an upload in flight | `ModelCheckpoint` sync save "
             "| `AsyncCheckpointIO` | DCP `async_save` | sync / ours | async / ours | DCP / ours |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in full:
        ours = r["ours_blocked"]
        lines.append(f"| {r['size_mib']} MiB | {ours:.3f} s | {r['ours_blocked_busy']:.3f} s | "
                     f"{r['sync_blocked']:.3f} s | {r['async_blocked']:.3f} s | {r['dcp_blocked']:.3f} s | "
                     f"{r['sync_blocked'] / ours:.1f}x | "
                     f"{r['async_blocked'] / ours:.1f}x | {r['dcp_blocked'] / ours:.1f}x |")
    loops = [r for result in results for r in result.get("loops", [])]
    if loops:
        lines += ["", "In a training loop (MLP with a third of the state as parameters, Adam, batch 16, a checkpoint "
                      f"every {LOOP_EVERY} steps): blocked = time in the checkpoint's calls (ours, background: the "
                      "start plus "
                      f"the commit before the next optimizer step, which waits for what is left of the copy); cost = "
                      f"the wall time of the {LOOP_EVERY} steps from the checkpoint on minus as many without one "
                      f"(includes the background work's slowdown of training):", "",
                  "| state | torch threads | step | ours, background: blocked / cost | ours, sync: blocked / cost "
                  "| `AsyncCheckpointIO`: blocked / cost | `ModelCheckpoint` sync: blocked / cost "
                  "| async / ours (blocked) | sync / ours (blocked) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in loops:
            ours = r["ours_bg_blocked"]
            lines.append(f"| {r['size_mib']} MiB | {r['threads']} | {r['step']:.3f} s | "
                         f"{ours:.3f} / {r['ours_bg_cost']:.3f} s "
                         f"| {r['ours_sync_blocked']:.3f} / {r['ours_sync_cost']:.3f} s "
                         f"| {r['async_blocked']:.3f} / {r['async_cost']:.3f} s | {r['sync_blocked']:.3f} / "
                         f"{r['sync_cost']:.3f} s | {r['async_blocked'] / ours:.1f}x | "
                         f"{r['sync_blocked'] / ours:.1f}x |")
    lines += ["", "Time from the save call to durable (manifest written) vs a raw write + fsync of the same bytes, "
              "each checkpoint paired with a raw write right after it (ratio: median of the pairs' ratios); "
              "unbounded, as the SIGTERM flush runs, and at the bound periodic copies start at when paced "
              f"({PACING_START_BYTES_PER_SECOND / MiB:g} MiB/s):", "",
              "| state | to durable | raw write + fsync | ratio | upload alone / raw | upload rate "
              f"| to durable at {PACING_START_BYTES_PER_SECOND / MiB:g} MiB/s |",
              "|---|---|---|---|---|---|---|"]
    for r in full:
        upload = r["to_durable"] - r["ours_blocked"]
        lines.append(f"| {r['size_mib']} MiB | {r['to_durable']:.3f} s | {r['raw_fsync']:.3f} s | "
                     f"{r['to_durable_ratio']:.2f}x | {upload / r['raw_fsync']:.2f}x | "
                     f"{r['upload_mib_s']:.0f} MiB/s | {r['to_durable_bounded']:.3f} s |")
    kinds = [k for k in (full[0]["slowdown"] if full else {})]

    def kind_name(kind) -> str:
        if isinstance(kind, float):
            return f"ours, {kind:g} MiB/s" if kind else "ours, unbounded"
        return {"dd": "`dd oflag=direct`, other process", "memcpy": f"memory copy {DEFAULT_MAX_MIB_PER_SECOND:g} MiB/s",
                "sleep": "A/A (sleep)"}[kind]

    lines += ["", "A single-threaded compute loop (16 256x256 matmuls and tanh, ~0.02 s) while something runs vs "
              "alone right after: our upload of the committed snapshot at each bandwidth bound, the same bytes "
              "copied by `dd` in another process at full speed, a thread copying memory at the default bound's "
              "rate (no disk), a thread that sleeps (A/A control); window by window in turn, median over windows of "
              "the per-window median ratio; lost = slowdown x the window's length (compute time the whole copy "
              "costs):", "",
              "| state | windows | " + " | ".join(kind_name(k) for k in kinds) + " |",
              "|---|---|" + "---|" * len(kinds)]
    for r in full:
        cells = [f"{r['slowdown'][k] * 100:+.1f} % ({r['slowdown_seconds'][k]:.1f} s, lost "
                 f"{r['slowdown'][k] * r['slowdown_seconds'][k]:.2f} s)" for k in kinds]
        lines.append(f"| {r['size_mib']} MiB | {r['windows']} | " + " | ".join(cells) + " |")
    paced = [r["pacing"] for r in results if "pacing" in r]
    if paced:
        lines += ["", "Pacing in a training loop (the MLP above, torch on one thread, batch 4; a snapshot and a "
                      "durable copy every so many steps that a copy at 64 MiB/s takes a third of the interval; paced "
                      "as by default: budget 2 %, start 64 MiB/s, at most "
                      f"{DEFAULT_MAX_MIB_PER_SECOND:g} MiB/s): the bound after each verdict, and over the run's second "
                      "half the median step an upload ran through against the median step no upload touched "
                      "(measured by the bench, not by the pacer):", "",
                  "| state | steps (copy every) | step | bound after each verdict (MiB/s) | slowdown during uploads "
                  "| steps during / without uploads |",
                  "|---|---|---|---|---|---|"]
        for r in paced:
            bounds = ", ".join(f"{rate:g}" for rate in r["rates"]) or "no verdict (64)"
            lines.append(f"| {r['size_mib']} MiB | {r['steps']} ({r['every']}) | {r['step']:.3f} s | {bounds} | "
                         + (f"{r['slowdown'] * 100:+.1f} % |" if r["slowdown"] is not None else "n/a |")
                         + f" {r['busy']} / {r['idle']} |")
    lines += ["", "CPU: machine-wide (/proc/stat, write-back included) for one upload, ours (direct I/O) vs the same "
              "upload through the page cache (`sendfile`); a CRC-32 pass over the shard (the upload no longer runs "
              "one: its checksum is the snapshot header's CRC) and the snapshot's own verification (block sums; paid "
              "only by a read back or a download):", "",
              "| state | upload CPU (direct) | upload CPU (page cache) | CRC-32 pass | verify (block sums) |",
              "|---|---|---|---|---|"]
    for r in full:
        lines.append(f"| {r['size_mib']} MiB | {r['upload_cpu']:.2f} s | {r['upload_cpu_buffered']:.2f} s | "
                     f"{r['crc_cpu']:.2f} s | {r['verify_cpu']:.2f} s |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1024", help="state sizes in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; do not update RESULTS.md")
    parser.add_argument("--loop-threads", default="1,2",
                        help="torch threads of the training-loop section (empty: skip it)")
    parser.add_argument("--bounds", default="64,128,512,0",
                        help="bandwidth bounds (MiB/s, 0: unbounded) of the slowdown section")
    parser.add_argument("--pacing-uploads", type=int, default=8,
                        help="durable copies in the pacing section per size (0: skip it)")
    parser.add_argument("--only-pacing", action="store_true", help="only the pacing section (print; no write)")
    parser.add_argument("--only-loop", action="store_true", help="only the training-loop section (print; no write)")
    args = parser.parse_args()
    bounds = list(dict.fromkeys(float(b) for b in args.bounds.split(",") if b))
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="bench-durable-", dir=HERE))
    try:
        results = []
        for size in args.sizes.split(","):
            run_dir = scratch / size
            run_dir.mkdir()
            only = args.only_loop or args.only_pacing
            result = {"size_mib": int(size)} if only else run_size(int(size), args.repeats, run_dir, bounds)
            result["loops"] = [] if args.only_pacing else [
                loop_costs(int(size), args.repeats, run_dir, int(threads))
                for threads in args.loop_threads.split(",") if threads]
            if args.pacing_uploads and not args.only_loop:
                result["pacing"] = pacing_loop(int(size), run_dir, args.pacing_uploads)
            results.append(result)
            shutil.rmtree(run_dir, ignore_errors=True)
            print(results[-1], flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    text = render(results, (load_before, os.getloadavg()[0]))
    print(text)
    if not args.no_write and not args.only_loop and not args.only_pacing:
        from bench_snapshot import write_results

        print("updated", write_results(text, SECTION))


if __name__ == "__main__":
    main()

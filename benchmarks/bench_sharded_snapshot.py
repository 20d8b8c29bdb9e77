"""Sharded snapshot (FSDP2) against Lightning's ModelParallelStrategy checkpoint (torch DCP), in one run.

Two processes (gloo on 127.0.0.1, CPU, one intra-op thread each) shard an ``nn.Sequential`` of
``--layers`` ``nn.Linear`` layers with FSDP2 ``fully_shard`` (every layer, then the root) over a
1-D device mesh of the 2 ranks, and take one real Adam step, so each rank holds its shards of the
parameters and of Adam's two moments: ``--mib`` MiB of sharded training state across both ranks.
The checkpoint dict is built the way Lightning's ``ModelParallelStrategy`` builds it with
``save_distributed_checkpoint=True`` (``get_model_state_dict`` / ``get_optimizer_state_dict``
with ``StateDictOptions(full_state_dict=False, cpu_offload=True)``, plus the small loop entries).
Measured at the same step, alternating (the order flips every repetition), with a training step
before each repetition:

* ours, sync: what ``EmergencyCheckpoint.save_now`` does for sharded state: the checkpoint dict ->
  ``dtensors_to_shards`` (what ``dump_checkpoint`` applies: each rank's own shards as plain
  records) -> ``SnapshotStore.save`` into a private directory under ``/dev/shm``
  (``keep_last=2``, steady state: the oldest file is recycled);
* ours, background: what a periodic snapshot with ``background_copy`` does: the same dict and
  records -> ``SnapshotStore.save_in_background`` with ``changed_only_by_optimizer_steps`` as
  the deferral rule (parameters and optimizer state copied on a helper thread); reported are the
  blocked part (until ``save_in_background`` returns) and the total until ``commit_pending``
  (called at once here; in training it runs at the next optimizer step, after forward/backward);
* anchor, DCP: what ``trainer.save_checkpoint`` does with ``ModelParallelStrategy``: the same
  checkpoint dict -> path broadcast -> ``torch.distributed.checkpoint.save`` of
  ``{"state_dict", "optimizer_0"}`` into a fresh directory on disk (``--disk-dir``; DCP's default
  ``FileSystemWriter``: one file per rank, fsync'd) -> ``meta.pt`` (``torch.save`` of the rest, rank
  0) -> barrier.

Every timing starts after a barrier and is the maximum over the two ranks (the step after a
snapshot waits for the slowest rank); each variant includes building its checkpoint dict. The
first round (fresh snapshot files, DCP's first save) is untimed and printed on its own. Reported:
min and median seconds, seconds per GiB of sharded state (both ranks' shards together) and
DCP / ours (how many times less time a training step is blocked).

Usage: ``.venv/bin/python benchmarks/bench_sharded_snapshot.py [--mib 256] [--reps 5] [--layers 8]
[--disk-dir /tmp] [--timeout 900]``
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import queue
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
WORLD = 2
VARIANTS = ("ours_sync", "ours_bg_blocked", "ours_bg_total", "dcp")
LABELS = {
    "ours_sync": "ours: sync `SnapshotStore.save`",
    "ours_bg_blocked": "ours: background, blocked (`save_in_background` returns)",
    "ours_bg_total": "ours: background, until `commit_pending`",
    "dcp": "anchor: DCP save to disk (ModelParallelStrategy)",
}


# ---------------------------------------------------------------------------------------- worker
def _worker(rank: int, port: int, opts: dict[str, Any], shm_root: str, disk_root: str, results: Any) -> None:
    try:
        out = _run(rank, port, opts, shm_root, disk_root)
        if rank == 0:
            results.put(("ok", out))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise


def _run(rank: int, port: int, opts: dict[str, Any], shm_root: str, disk_root: str) -> dict[str, Any]:
    import lightning
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_ft.checkpoint.lightning.background import changed_only_by_optimizer_steps
    from lightning_ft.checkpoint.memory.store import SnapshotStore
    from lightning_ft.checkpoint.sharded import count_shards, dtensors_to_shards

    torch.set_num_threads(opts["threads"])
    timeout = datetime.timedelta(seconds=opts["timeout"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timeout)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)  # the same initial weights on both ranks, as a fresh fit() has
        width, layers = opts["width"], opts["layers"]
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
        torch.manual_seed(1 + rank)  # each rank its own data
        batch = torch.randn(8, width)

        def train_step() -> float:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            model(batch).pow(2).mean().backward()
            optimizer.step()
            return time.perf_counter() - start

        step = 0
        train_step()
        step += 1

        # the size of this rank's sharded state: local shards of parameters and Adam's moments
        local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        for state in optimizer.state.values():
            local_bytes += sum(v.to_local().numel() * v.element_size()
                               for v in state.values() if hasattr(v, "to_local"))
        sizes = torch.tensor([local_bytes], dtype=torch.int64)
        dist.all_reduce(sizes)
        total_bytes = int(sizes.item())

        sd_options = StateDictOptions(full_state_dict=False, cpu_offload=True)  # ModelParallelStrategy's

        def checkpoint_dict(global_step: int) -> dict[str, Any]:
            """What Lightning's dump_checkpoint returns for ModelParallelStrategy (distributed save):
            DTensor values from torch's state-dict API, plus the small loop entries."""
            return {
                "epoch": 0,
                "global_step": global_step,
                "pytorch-lightning_version": lightning.__version__,
                "state_dict": get_model_state_dict(model, options=sd_options),
                "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 0}},
                                       "epoch_loop.batch_progress": {"total": {"ready": global_step}}}},
                "callbacks": {},
                "optimizer_states": [get_optimizer_state_dict(model, optimizer, options=sd_options)],
                "lr_schedulers": [],
            }

        store = SnapshotStore(root=shm_root, run_id="bench-sharded", rank=rank, keep_last=2)
        deferred_used: list[bool] = []
        label = [0]  # snapshot step labels: every save its own (two saves per training step)

        def ours_sync() -> dict[str, float]:
            t0 = time.perf_counter()
            checkpoint = checkpoint_dict(step)
            t1 = time.perf_counter()
            records = dtensors_to_shards(checkpoint)
            t2 = time.perf_counter()
            label[0] += 1
            store.save(records, label[0], reason="periodic")
            t3 = time.perf_counter()
            return {"total": t3 - t0, "collect": t1 - t0, "to_shards": t2 - t1, "store": t3 - t2}

        def ours_bg() -> dict[str, float]:
            t0 = time.perf_counter()
            checkpoint = checkpoint_dict(step)
            records = dtensors_to_shards(checkpoint)
            deferred = changed_only_by_optimizer_steps([optimizer])
            label[0] += 1
            store.save_in_background(records, label[0], deferred, reason="periodic")
            t1 = time.perf_counter()
            # private, read only: whether the large tensors really went to the helper thread
            deferred_used.append(store._pending is not None and store._pending.copier is not None)
            store.commit_pending()
            t2 = time.perf_counter()
            return {"blocked": t1 - t0, "total": t2 - t0}

        def anchor_dcp() -> dict[str, float]:
            t0 = time.perf_counter()
            checkpoint = checkpoint_dict(step)
            t1 = time.perf_counter()
            where = [os.path.join(disk_root, f"step={step}")]
            dist.broadcast_object_list(where, src=0)  # as ModelParallelStrategy.save_checkpoint
            path = Path(where[0])
            path.mkdir(parents=True, exist_ok=True)
            converted = {"state_dict": checkpoint.pop("state_dict")}
            converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
            dcp.save(converted, checkpoint_id=path)
            t2 = time.perf_counter()
            if rank == 0:
                torch.save(checkpoint, path / "meta.pt")
            dist.barrier()  # Trainer.save_checkpoint's
            t3 = time.perf_counter()
            return {"total": t3 - t0, "collect": t1 - t0, "dcp_save": t2 - t1}

        def timed(fn: Any) -> list[dict[str, float]]:
            dist.barrier()
            mine = fn()
            everyone: list[Any] = [None] * WORLD
            dist.all_gather_object(everyone, mine)
            return everyone

        def clean_disk() -> None:
            dist.barrier()
            if rank == 0:
                for entry in os.listdir(disk_root):
                    shutil.rmtree(os.path.join(disk_root, entry), ignore_errors=True)
            dist.barrier()

        rounds: list[dict[str, list[dict[str, float]]]] = []
        train_seconds = []
        for rep in range(opts["reps"] + 1):  # round 0: the untimed first saves
            if rep:
                train_seconds.append(train_step())
                step += 1
            found: dict[str, list[dict[str, float]]] = {}
            order = [("sync", ours_sync), ("bg", ours_bg), ("dcp", anchor_dcp)]
            for name, fn in order if rep % 2 == 0 else reversed(order):
                found[name] = timed(fn)
                if name == "dcp":
                    clean_disk()
            rounds.append(found)

        # the last snapshot holds this step's shards: load it back and compare one of them
        loaded = store.load()
        first_key = next(iter(model.state_dict()))
        matches = torch.equal(loaded["state_dict"][first_key]["local"], model.state_dict()[first_key].to_local())
        shards = count_shards(loaded)
        checks: list[Any] = [None] * WORLD
        dist.all_gather_object(checks, (bool(matches), shards, all(deferred_used)))
        snapshot_bytes = store.latest().nbytes
        store.close()
        return {"rounds": rounds, "total_bytes": total_bytes, "checks": checks, "snapshot_bytes": snapshot_bytes,
                "train_seconds": train_seconds}
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fs_type(path: str) -> str:
    """The file system type of the mount ``path`` is on (from /proc/mounts; "?" when unknown)."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if len(fields) >= 3 and inside and len(point) > len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def _width(mib: float, layers: int) -> int:
    """Width of square Linear layers whose weights and biases, with Adam's two moments, hold ``mib`` MiB."""
    params = mib * MiB / 4 / 3
    width = int((-1 + math.sqrt(1 + 4 * params / layers)) / 2)
    return max(WORLD, width - width % WORLD)


def _launch(opts: dict[str, Any], shm_root: str, disk_root: str) -> dict[str, Any]:
    """Run both ranks; kill them all if one fails or the hard timeout passes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, opts, shm_root, disk_root, results), daemon=True,
                         name=f"bench-sharded-rank{rank}") for rank in range(WORLD)]
    deadline = time.monotonic() + opts["timeout"]
    out: dict[str, Any] | None = None
    failure = None
    try:
        for proc in procs:
            proc.start()
        while time.monotonic() < deadline:
            try:
                message = results.get(timeout=0.5)
            except queue.Empty:
                message = None
            if message is not None and message[0] == "ok":
                out = message[1]
            elif message is not None:
                failure = f"rank {message[1]} failed:\n{message[2]}"
                break
            if message is None and not any(p.is_alive() for p in procs):
                if out is None:
                    failure = "both ranks exited without a result"
                break
            dead = [p for p in procs if not p.is_alive() and p.exitcode]
            if dead:
                failure = f"{dead[0].name} exited with code {dead[0].exitcode}"
                break
        else:
            failure = f"hard timeout: {opts['timeout']} s passed"
    finally:
        if failure is None:
            for proc in procs:
                proc.join(timeout=10)
        for proc in procs:  # a failure, a timeout, or a rank that would not exit: kill them all at once
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        results.close()
    if failure is not None or out is None:
        raise SystemExit(f"benchmark failed: {failure or 'no result from rank 0'}")
    return out


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256, help="sharded training state across both ranks (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each variant")
    parser.add_argument("--layers", type=int, default=8, help="nn.Linear layers (square)")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(), help="parent of DCP's checkpoint directory")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--timeout", type=float, default=900, help="hard limit for the whole run (s)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    width = _width(args.mib, args.layers)
    opts = {"width": width, "layers": args.layers, "reps": args.reps, "threads": args.threads,
            "timeout": args.timeout}

    shm_root = tempfile.mkdtemp(prefix="bench-sharded-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    disk_root = tempfile.mkdtemp(prefix=".bench-sharded-dcp-", dir=args.disk_dir)
    os.chmod(shm_root, 0o700)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    try:
        out = _launch(opts, shm_root, disk_root)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)
    wall = time.monotonic() - started

    total = out["total_bytes"]
    gib = total / GiB
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {WORLD} ranks (gloo, CPU, {args.threads} thread(s) "
          f"each), FSDP2 over a 1-D mesh of {WORLD}")
    print(f"model: {args.layers} x nn.Linear({width}, {width}); sharded state after 1 Adam step: "
          f"{total / MiB:.1f} MiB across ranks ({gib:.3f} GiB; params + exp_avg + exp_avg_sq), "
          f"snapshot file per rank {out['snapshot_bytes'] / MiB:.1f} MiB")
    print(f"ours -> {shm_root} ({_fs_type(shm_root)}); DCP -> {disk_root} ({_fs_type(disk_root)})")
    for rank, (matches, shards, deferred) in enumerate(out["checks"]):
        print(f"rank {rank}: snapshot loaded back holds {shards} shard records, first shard equal to the live one: "
              f"{matches}; background copies deferred to the helper thread: {deferred}")
    print(f"training step (fwd/bwd/Adam) median {_fmt(statistics.median(out['train_seconds']))}")

    def worst(entries: list[dict[str, float]], key: str) -> float:
        return max(entry[key] for entry in entries)

    def series(rounds: list[dict[str, Any]]) -> dict[str, list[float]]:
        return {"ours_sync": [worst(r["sync"], "total") for r in rounds],
                "ours_bg_blocked": [worst(r["bg"], "blocked") for r in rounds],
                "ours_bg_total": [worst(r["bg"], "total") for r in rounds],
                "dcp": [worst(r["dcp"], "total") for r in rounds]}

    first = series(out["rounds"][:1])
    timed = series(out["rounds"][1:])
    anchor_min, anchor_med = min(timed["dcp"]), statistics.median(timed["dcp"])
    print()
    print(f"Blocked time, max over ranks, {args.reps} reps (after 1 untimed first round), {total / MiB:.0f} MiB "
          "of sharded state:")
    print()
    print("| variant | min | median | s/GiB (median) | **DCP / this** (median; min) | first round |")
    print("|---|---|---|---|---|---|")
    for name in VARIANTS:
        values = timed[name]
        lo, med = min(values), statistics.median(values)
        ratio = "-" if name == "dcp" else f"**{anchor_med / med:.1f}x** ({anchor_min / lo:.1f}x)"
        print(f"| {LABELS[name]} | {lo:.3f} s | {med:.3f} s | {med / gib:.3f} | {ratio} | {first[name][0]:.3f} s |")

    def component(kind: str, key: str) -> float:
        return statistics.median(worst(r[kind], key) for r in out["rounds"][1:])

    print()
    print("Parts (median of max over ranks): "
          f"state-dict API (get_model/optimizer_state_dict) {_fmt(component('sync', 'collect'))}, "
          f"dtensors_to_shards {_fmt(component('sync', 'to_shards'))}, "
          f"SnapshotStore.save {_fmt(component('sync', 'store'))}; "
          f"DCP: state-dict API {_fmt(component('dcp', 'collect'))}, dcp.save {_fmt(component('dcp', 'dcp_save'))}")
    print("Per rep (max over ranks), s: " + "; ".join(
        f"{name} " + " ".join(f"{v:.3f}" for v in timed[name]) for name in VARIANTS))
    print(f"wall {wall:.0f} s; 1-min load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()

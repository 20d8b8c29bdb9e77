"""State transfer to a hot spare: seconds per GiB of snapshot, against raw gloo in the same run.

Two processes form a gloo group on 127.0.0.1, as a survivor and a spare do after a round
forms. Rank 0 holds an in-memory snapshot of ``--gib`` GiB (one float32 parameter tensor; its
file in a private ``/dev/shm`` root); rank 1 holds none. Measured, alternating:

* ``exchange``: :func:`lightning_ft.checkpoint.exchange.transfer.exchange_snapshots`, what a
  recovery runs: both ranks agree on the newest step, rank 0 reads and verifies its file and
  sends it, rank 1 receives, checks and commits it as its own snapshot;
* ``raw gloo``: ``dist.send``/``recv`` of a uint8 tensor of the same size (the anchor: what
  the network path costs with nothing of ours around it).

Prints the medians, seconds per GiB and the ratio exchange / raw gloo.

    python benchmarks/bench_transfer.py [--gib 1.0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_ft.checkpoint.exchange.transfer import exchange_snapshots  # noqa: E402
from lightning_ft.checkpoint.memory.store import SnapshotStore  # noqa: E402


def _worker(rank: int, port: int, root: str, gib: float, repeats: int, results: dict) -> None:
    os.environ["LIGHTNING_FT_RUN_ID"] = "bench-transfer"
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    # a root per rank: every node has a /dev/shm of its own (one shared root would let the spare
    # read rank 0's file directly, and nothing would be sent)
    node_root = os.path.join(root, f"node{rank}")
    snapshots = SnapshotStore(root=node_root, run_id="bench-transfer", rank=rank, keep_last=1)
    numel = int(gib * 2**30) // 4
    if rank == 0:
        snapshots.save({"state_dict": {"weight": torch.randn(numel)}, "global_step": 100}, step=100)
    raw = torch.empty(numel * 4, dtype=torch.uint8)
    timings: dict[str, list[float]] = {"exchange": [], "raw gloo": []}
    for _ in range(repeats):
        if rank == 1:  # a spare that just joined holds nothing
            for info in snapshots.list():
                os.unlink(info.path)
        dist.barrier()
        start = time.perf_counter()
        plan = exchange_snapshots(snapshots, rank, 2, lambda *a, **k: None)
        dist.barrier()
        timings["exchange"].append(time.perf_counter() - start)
        assert plan is not None and list(plan.receivers) == [1], plan
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(raw, dst=1)
        else:
            dist.recv(raw, src=0)
        dist.barrier()
        timings["raw gloo"].append(time.perf_counter() - start)
    if rank == 0:
        nbytes = snapshots.list()[0].nbytes
        results.update({name: statistics.median(values) for name, values in timings.items()})
        results["bytes"] = nbytes
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench-transfer-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(root, 0o700)
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_worker, args=(port, root, args.gib, args.repeats, results), nprocs=2, join=True)
            found = dict(results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = found["bytes"] / 2**30
    print(f"snapshot of {found['bytes'] / 2**20:.0f} MiB, medians of {args.repeats}:")
    for name in ("exchange", "raw gloo"):
        print(f"  {name:<10} {found[name]:7.3f} s  {found[name] / gib:7.3f} s/GiB")
    print(f"exchange / raw gloo: {found['exchange'] / found['raw gloo']:.2f}x")


if __name__ == "__main__":
    main()

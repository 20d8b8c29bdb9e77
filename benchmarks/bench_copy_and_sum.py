"""Snapshot save with the block sums following the copy on a helper thread vs one pass after it.

Alternating steady-state saves of one ``SnapshotStore`` in /dev/shm (recycled files), the
helper switched on and off through ``copying.PIPELINE_MIN_BYTES``; prints the median
of each and their ratio (the anchor is the one-pass save of the same run).

Usage: ``T=1 .venv/bin/python benchmarks/bench_copy_and_sum.py [tensors] [floats per tensor]``
(``T``: torch threads; the helper runs only with one, so ``T=2`` measures the same path twice).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from lightning_ft.checkpoint.memory import copying
from lightning_ft.checkpoint.memory.store import SnapshotStore


def main() -> None:
    torch.set_num_threads(int(os.environ.get("T", "1")))
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    per = int(sys.argv[2]) if len(sys.argv) > 2 else 64 << 20
    torch.manual_seed(0)
    state = {"state_dict": {f"t{i}": torch.randn(per) for i in range(count)}}
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="bench-copy-and-sum-")
    store = SnapshotStore(root, run_id="bench", rank=0, keep_last=2)
    seconds: dict[str, list[float]] = {"helper": [], "one pass": []}
    default = copying.PIPELINE_MIN_BYTES
    try:
        step = 0
        for repeat in range(7):
            for name, threshold in (("helper", default), ("one pass", 1 << 62)):
                copying.PIPELINE_MIN_BYTES = threshold
                step += 1
                start = time.perf_counter()
                store.save(state, step)
                if repeat:  # the first round allocates the files
                    seconds[name].append(time.perf_counter() - start)
    finally:
        copying.PIPELINE_MIN_BYTES = default
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    helper, one_pass = (statistics.median(seconds[k]) for k in ("helper", "one pass"))
    print(f"{count} x {per * 4 >> 10} KiB, torch threads {torch.get_num_threads()}: helper {helper:.3f} s, "
          f"one pass {one_pass:.3f} s, helper / one pass {helper / one_pass:.2f}")


if __name__ == "__main__":
    main()

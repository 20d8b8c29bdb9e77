"""Frozen active -> training resumed (issue 45, "faster hang detection").

Real processes on 127.0.0.1 (``tests/scripts/ft_train.py``, ``strategy="ddp_ft"``): A (hosting the
store) and B active, C a hot spare (``2:3``). At step 60 B is frozen (SIGSTOP, as a hung host or a
stopped container would be) and stays frozen. Measured: from the SIGSTOP to the first step the job
completes after it (on A with C in B's place), and the job's median step time before the freeze
as the anchor (the freeze costs that many steps). Each repeat is a fresh job; B is thawed and
killed at the end.

    python benchmarks/bench_freeze.py [--repeats 3] [--step-sleep 0.03]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from ft_cluster import Cluster, in_order, ordered_start, release  # noqa: E402
from procs import ProcessSet  # noqa: E402  (examples/: fresh interpreters, as a scheduler starts them)

FREEZE_AT = 60


def one_run(root: Path, step_sleep: float) -> dict:
    procs = ProcessSet(root, cwd=REPO)
    cluster = Cluster(procs, root, "2:3", run_id="bench-freeze")
    args = ["--max-steps", "100000", "--step-sleep", str(step_sleep), "--snapshot-every", "10"]
    try:
        cluster.out.mkdir(parents=True)
        hold = ordered_start(cluster, "AB")
        for infra_rank, name in enumerate("ABC"):
            cluster.start_participant(name, [*args, *hold], LIGHTNING_FT_INFRA_RANK=str(infra_rank))
            if name == "A":
                cluster.wait_for_log("A", "hosting the rendezvous store")
            in_order(cluster, name, actives="AB")
        release(hold)
        cluster.wait_for_step(FREEZE_AT, 120, among=["A"])
        frozen_at = cluster.kill("B", signal.SIGSTOP)
        before = [r for r in cluster.steps()["A"] if r["t"] < frozen_at]
        last = before[-1]["step"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            after = [r for r in cluster.steps()["C"] if r["t"] > frozen_at]
            if after:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"the spare trained no step within 60 s of the freeze; logs in {root}")
        times = [r["t"] for r in before[-40:]]
        step = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
        return {"seconds": after[0]["t"] - frozen_at, "median_step_s": step, "frozen_after_step": last,
                "resumed_step": after[0]["step"]}
    finally:
        try:
            cluster.kill("B", signal.SIGCONT)
        except (KeyError, ProcessLookupError):
            pass
        procs.kill_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--keep", help="run in this directory and keep the logs")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-freeze-"))
    runs = []
    for repeat in range(args.repeats):
        run = one_run(root / f"run{repeat}", args.step_sleep)
        runs.append(run)
        print(f"run {repeat}: SIGSTOP after step {run['frozen_after_step']} -> step {run['resumed_step']} on the spare "
              f"after {run['seconds']:.2f}s (median step {1000 * run['median_step_s']:.1f} ms)", flush=True)
    seconds = statistics.median(r["seconds"] for r in runs)
    step = statistics.median(r["median_step_s"] for r in runs)
    print(f"median freeze -> next step: {seconds:.2f}s = {seconds / step:.0f} median steps (goal <= 2 s)")
    print(json.dumps({"runs": runs, "median_seconds": seconds, "median_step_s": step}))


if __name__ == "__main__":
    main()

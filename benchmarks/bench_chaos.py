"""Endurance benchmark (issue 45): a fault every few seconds while a job trains, against the same job
without faults in the same run.

Real processes on 127.0.0.1 (``tests/scripts/ft_train.py``, ``strategy="ddp_ft"``), launched as a
scheduler launches them: every participant with the same launch settings (no standalone store: the
first hosts it), a job secret, 2 actives + 2 hot spares (``2:4``). Two jobs, one after the other:

* ``fault-free``: the job trains ``--max-steps``; its time from the first step to the end is the anchor
  (run before and after the chaos job, averaged: this machine's speed drifts within minutes).
* ``chaos``: the same job; every ``--every`` seconds the next fault of the cycle hits it -- SIGKILL an
  active, SIGTERM an active (a hand-over), SIGSTOP an active for ``--freeze`` seconds, SIGKILL a
  spare, SIGKILL the store's host, SIGKILL two actives at once -- and every process that ended is
  replaced ``--replace-after`` seconds later by a fresh one with the same launch settings (what a
  scheduler does). A thawed process that was replaced ends by itself (it is not replaced again).

Reported: throughput retained (fault-free time / chaos time for the same steps), the faults with
the first step of the job after each, whether the job ever split (a process trained a step that the
job had passed, from a fresh start), the steps trained twice, the exit codes, and whether the final
weights equal the fault-free run's. Each fault and its recovery is one line of the timeline.

    python benchmarks/bench_chaos.py [--max-steps 3000] [--every 25] [--step-sleep 0.03]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from chaos_job import FAULTS, ChaosJob, job_args  # noqa: E402

from procs import ProcessSet  # noqa: E402  (examples/: fresh interpreters, as a scheduler starts them)


def run_job(args, root: Path, name: str, chaos: bool) -> dict:
    procs = ProcessSet(root, cwd=REPO)
    job = ChaosJob(procs, root, f"bench-{name}", job_args(args.max_steps, args.step_sleep, args.snapshot_every),
                   tuple(args.replace_after), args.seed)
    try:
        job.start(4)
        deadline = time.monotonic() + args.timeout
        started = job.first_step_at(args.timeout)
        job.started = started
        faults = itertools.cycle(FAULTS)
        next_fault = time.monotonic() + args.every
        while not job.finished():
            if time.monotonic() > deadline:
                for line in job.timeline:
                    print(json.dumps(line))
                raise RuntimeError(f"the job did not finish within the timeout (logs in {root})")
            job.tend()
            if chaos and time.monotonic() >= next_fault:
                next_fault = time.monotonic() + args.every
                job.inject(next(faults), args.freeze)
            time.sleep(0.05)
        summary = job.summary(started)
        job.cluster.wait(list(job.cluster.procs), 60)
        summary["codes"] = {n: p.popen.poll() for n, p in job.cluster.procs.items()}
        summary["left_running"] = [n for n, c in summary["codes"].items() if c is None]
        return summary
    finally:
        procs.kill_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--snapshot-every", type=int, default=50)
    parser.add_argument("--every", type=float, default=25.0, help="seconds between faults")
    parser.add_argument("--freeze", type=float, default=12.0, help="seconds a frozen active stays frozen")
    parser.add_argument("--replace-after", type=float, nargs=2, default=(3.0, 5.0), metavar=("MIN", "MAX"))
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=45)
    parser.add_argument("--json", default=None, help="write both results here")
    parser.add_argument("--keep", default=None, metavar="DIR", help="run in DIR and keep the logs")
    parser.add_argument("--chaos-only", action="store_true", help="no fault-free anchor (to look at the faults)")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-chaos-"))
    try:
        if args.chaos_only:
            chaos = run_job(args, root / "chaos", "chaos", chaos=True)
            print(json.dumps({k: v for k, v in chaos.items() if k != "timeline"}))
            return
        # the anchor before and after the chaos run: this machine's speed drifts within minutes
        before = run_job(args, root / "free-before", "fault-free", chaos=False)
        chaos = run_job(args, root / "chaos", "chaos", chaos=True)
        after = run_job(args, root / "free-after", "fault-free", chaos=False)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    free = dict(before, seconds=(before["seconds"] + after["seconds"]) / 2)
    print(f"fault-free runs: {before['seconds']:.1f} s before, {after['seconds']:.1f} s after the chaos run")
    for line in chaos["timeline"]:
        print(json.dumps(line))
    print(f"fault-free: {free['steps']} steps in {free['seconds']:.1f} s; chaos: {chaos['steps']} steps in "
          f"{chaos['seconds']:.1f} s; faults: {sum(1 for t in chaos['timeline'] if 'fault' in t)}")
    print(f"throughput retained: {free['seconds'] / chaos['seconds']:.3f} (fault-free time / chaos time, same steps)")
    print(f"second jobs (fresh starts after the first step): {chaos['fresh_starts']}; steps trained more than "
          f"once per rank: {chaos['steps_trained_twice']}; processes left running: {chaos['left_running']}")
    print(f"final weights equal to the fault-free run: {chaos['weights'] == free['weights']} "
          f"({len(chaos['weights'])} distinct in the chaos run)")
    if args.json:
        Path(args.json).write_text(json.dumps({"fault_free": [before, after], "chaos": chaos}, indent=1))


if __name__ == "__main__":
    main()

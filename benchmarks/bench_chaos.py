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
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from ft_cluster import Cluster  # noqa: E402
from procs import ProcessSet  # noqa: E402  (examples/: fresh interpreters, as a scheduler starts them)

FAULTS = ("kill-active", "sigterm-active", "freeze-active", "kill-spare", "kill-store-host", "kill-two-actives")


def _args(args) -> list[str]:
    # two copies of each snapshot wanted besides the actives' own: with 2 actives the spares hold
    # one each, so losing both actives at once leaves the job its newest snapshot
    return ["--max-steps", str(args.max_steps), "--step-sleep", str(args.step_sleep), "--resumable-data",
            "--snapshot-every", str(args.snapshot_every), "--hang-floor", "30", "--replication-factor", "2"]


class Job:
    """One job of the benchmark: its cluster, names in start order, and who is alive."""

    def __init__(self, args, root: Path, name: str) -> None:
        self.args = args
        self.procs = ProcessSet(root, cwd=REPO)
        self.cluster = Cluster(self.procs, root, "2:4", run_id=f"bench-{name}")
        self.cluster.out.mkdir(parents=True)
        # a durable tier as a user's job has one: a job lost as a whole resumes from it, never from step 0
        self.secret = {"LIGHTNING_FT_SECRET": "bench-chaos-secret", "LIGHTNING_FT_PERSIST_TO": str(root / "durable"),
                       "LIGHTNING_FT_PERSIST_EVERY_SECONDS": "5"}
        self.names = (f"n{i}" for i in itertools.count())
        self.ended: set[str] = set()
        self.frozen: set[str] = set()

    def start(self, count: int) -> None:
        for _ in range(count):
            self.cluster.start_participant(next(self.names), _args(self.args), **self.secret)

    def running(self) -> list[str]:
        return [n for n, p in self.cluster.procs.items() if p.popen.poll() is None]

    def actives(self, within: float = 1.5) -> list[str]:
        """Processes that completed a step in the last ``within`` seconds."""
        now = time.time()
        steps = self.cluster.steps()
        return [n for n in self.running() if steps.get(n) and now - steps[n][-1]["t"] < within and n not in self.frozen]

    def spares(self) -> list[str]:
        steps = self.cluster.steps()
        return [n for n in self.running() if n not in self.frozen and not steps.get(n)]

    def store_host(self) -> str | None:
        hosts = [n for n in self.running() if "hosting the rendezvous store" in self.cluster.procs[n].log()
                 or "hosted here" in self.cluster.procs[n].log()]
        return hosts[-1] if hosts else None

    def newest_step(self) -> int:
        return max((r["step"] for records in self.cluster.steps().values() for r in records), default=0)

    def finished(self) -> bool:
        """A rank returned from fit() at the last step (a node that handed its place over returns too)."""
        results = [self.cluster.result(n) for n in self.cluster.procs]
        return any(r is not None and r.get("step") == self.args.max_steps for r in results)


def run_job(args, root: Path, name: str, chaos: bool) -> dict:
    job = Job(args, root, name)
    rng = random.Random(args.seed)
    timeline: list[dict] = []
    try:
        job.start(4)
        deadline = time.monotonic() + args.timeout
        while job.newest_step() < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("no step within the timeout:\n" + job.cluster.logs())
            time.sleep(0.1)
        started = time.time()
        faults = itertools.cycle(FAULTS)
        next_fault = time.monotonic() + args.every
        pending: list[float] = []  # when a replacement starts
        thaw: list[tuple[float, str]] = []
        while not job.finished():
            if time.monotonic() > deadline:
                for line in timeline:
                    print(json.dumps(line))
                raise RuntimeError(f"the job did not finish within the timeout (logs in {root})")
            now = time.monotonic()
            for when, who in [t for t in thaw if t[0] <= now]:
                os.kill(job.cluster.procs[who].pid, signal.SIGCONT)
                job.frozen.discard(who)
                thaw.remove((when, who))
            for name_ in list(job.cluster.procs):
                if name_ not in job.ended and job.cluster.procs[name_].popen.poll() is not None:
                    job.ended.add(name_)
                    timeline.append({"t": round(time.time() - started, 2), "ended": name_,
                                     "code": job.cluster.procs[name_].popen.poll(), "step": job.newest_step()})
                    # the scheduler replaces an ended node; a thawed one that was replaced already
                    # ends too, and the job is not grown past its size for it
                    if len([n for n in job.running() if n not in job.frozen]) + len(pending) < 4:
                        pending.append(now + rng.uniform(*args.replace_after))
            for when in [p for p in pending if p <= now]:
                pending.remove(when)
                job.start(1)
                timeline.append({"t": round(time.time() - started, 2), "started": f"n{len(job.cluster.procs) - 1}"})
            if chaos and now >= next_fault:
                next_fault = now + args.every
                timeline.append(inject(job, next(faults), started, thaw, args))
            time.sleep(0.05)
        finished_at = max(r["t"] for records in job.cluster.steps().values() for r in records)
        job.cluster.wait(list(job.cluster.procs), 60)
        return summarize(job, started, finished_at, timeline)
    finally:
        job.procs.kill_all()


def inject(job: Job, kind: str, started: float, thaw: list, args) -> dict:
    actives, spares = job.actives(), job.spares()
    victims: list[str] = []
    sig = signal.SIGKILL
    if kind in ("kill-active", "sigterm-active", "freeze-active") and actives:
        victims = [actives[0]]
        sig = {"kill-active": signal.SIGKILL, "sigterm-active": signal.SIGTERM, "freeze-active": signal.SIGSTOP}[kind]
    elif kind == "kill-spare" and spares:
        victims = [spares[0]]
    elif kind == "kill-store-host" and (host := job.store_host()) is not None:
        victims = [host]
    elif kind == "kill-two-actives" and len(actives) >= 2:
        victims = actives[:2]
    record = {"t": round(time.time() - started, 2), "fault": kind, "victims": victims, "step": job.newest_step()}
    if len(victims) > 1:
        job.cluster.kill_together(victims)
    for victim in victims if len(victims) == 1 else []:
        os.kill(job.cluster.procs[victim].pid, sig)
        if sig == signal.SIGSTOP:
            job.frozen.add(victim)
            thaw.append((time.monotonic() + args.freeze, victim))
    return record


def summarize(job: Job, started: float, finished_at: float, timeline: list[dict]) -> dict:
    steps = job.cluster.steps()
    seen: dict[int, int] = {}
    fresh_starts = 0
    for records in steps.values():
        for r in records:
            seen[r["step"]] = seen.get(r["step"], 0) + 1
        if records and records[0]["step"] == 1 and records[0]["t"] > started + 1.0:
            fresh_starts += 1  # a process that trained step 1 after the job had passed it: a second job
    ranks = {r["rank"] for records in steps.values() for r in records}
    trained_twice = sum(1 for count in seen.values() if count > 2)  # 2 ranks train every step once
    results = [job.cluster.result(n) for n in job.cluster.procs]
    # the ranks that finished the job (a spare that was never needed reports its untrained weights)
    weights = sorted({json.dumps(r["weights"]) for r in results
                      if r is not None and r.get("rank", -1) >= 0 and r.get("step") == job.args.max_steps})
    codes = {n: p.popen.poll() for n, p in job.cluster.procs.items()}
    return {"seconds": finished_at - started, "steps": max(seen, default=0), "fresh_starts": fresh_starts,
            "steps_trained_twice": trained_twice, "ranks": sorted(ranks), "weights": weights, "codes": codes,
            "left_running": [n for n, c in codes.items() if c is None], "timeline": timeline}


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

"""A job under continuous faults, as issue 45 describes it: the endurance benchmark
(``benchmarks/bench_chaos.py``: a fault every few seconds for many minutes) and its short version
in the test suite (``tests/test_endurance.py``) drive it.

Real processes on 127.0.0.1 (``tests/scripts/ft_train.py``, ``strategy="ddp_ft"``), launched as a
scheduler launches them: every participant with the same launch settings (no standalone store: the
first hosts it), a job secret, a durable tier, 2 actives + 2 hot spares (``2:4``). The faults, in
turn: SIGKILL an active, SIGTERM an active (a hand-over), SIGSTOP an active (thawed later), SIGKILL
a spare, SIGKILL the store's host, SIGKILL two actives at once. Every process that ended is replaced
a few seconds later by a fresh one with the same launch settings (what a scheduler does); a thawed
process that was replaced ends by itself and is not replaced again.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from ft_cluster import Cluster

FAULTS = ("kill-active", "sigterm-active", "freeze-active", "kill-spare", "kill-store-host", "kill-two-actives")
#: the size of the job: 2 actives + 2 hot spares
NODES = 4


def job_args(max_steps: int, step_sleep: float, snapshot_every: int = 50) -> list[str]:
    """ft_train.py's arguments for a participant of the job (the fault-free anchor's too)."""
    # two copies of each snapshot wanted besides the actives' own: with 2 actives the spares hold
    # one each, so losing both actives at once leaves the job its newest snapshot
    return ["--max-steps", str(max_steps), "--step-sleep", str(step_sleep), "--resumable-data",
            "--snapshot-every", str(snapshot_every), "--hang-floor", "30", "--replication-factor", "2"]


class ChaosJob:
    """One job: its cluster, who is alive, frozen and waiting to be replaced, and its timeline."""

    def __init__(self, launcher: Any, root: Path, run_id: str, args: list[str],
                 replace_after: tuple[float, float] = (3.0, 5.0), seed: int = 45) -> None:
        self.cluster = Cluster(launcher, root, f"{NODES // 2}:{NODES}", run_id=run_id)
        self.cluster.out.mkdir(parents=True)
        self.args = args
        self.max_steps = int(args[args.index("--max-steps") + 1])
        # a durable tier as a user's job has one: a job lost as a whole resumes from it, never from step 0
        self.env = {"LIGHTNING_FT_SECRET": "chaos-job-secret", "LIGHTNING_FT_PERSIST_TO": str(root / "durable"),
                    "LIGHTNING_FT_PERSIST_EVERY_SECONDS": "5"}
        self.replace_after = replace_after
        self.rng = random.Random(seed)
        self.names = (f"n{i}" for i in itertools.count())
        self.ended: set[str] = set()
        self.frozen: set[str] = set()
        self.thaw: list[tuple[float, str]] = []
        self.pending: list[float] = []  # when a replacement starts
        self.timeline: list[dict] = []
        self.started = time.time()

    def start(self, count: int = 1) -> None:
        for _ in range(count):
            self.cluster.start_participant(next(self.names), self.args, **self.env)

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

    def ready_spares(self) -> list[str]:
        """Processes that stand by in the job's newest round they completed (not still starting; a
        thawed node that was replaced stands by again)."""
        actives = self.actives(within=3.0)
        return [n for n in self.running() if n not in self.frozen and n not in actives
                and self.cluster.procs[n].log().rfind("is standby") > self.cluster.procs[n].log().rfind("is active")]

    def whole(self) -> bool:
        """Two actives training, two spares standing by, nothing frozen or waiting to be replaced."""
        return len(self.actives()) == NODES // 2 and len(self.ready_spares()) >= NODES // 2 \
            and not self.frozen and not self.pending

    def store_host(self) -> str | None:
        hosts = [n for n in self.running() if "hosting the rendezvous store" in self.cluster.procs[n].log()
                 or "hosted here" in self.cluster.procs[n].log()]
        return hosts[-1] if hosts else None

    def newest_step(self) -> int:
        return max((r["step"] for records in self.cluster.steps().values() for r in records), default=0)

    def finished(self) -> bool:
        """A rank returned from fit() at the last step (a node that handed its place over returns too)."""
        results = [self.cluster.result(n) for n in self.cluster.procs]
        return any(r is not None and r.get("step") == self.max_steps for r in results)

    def tend(self) -> None:
        """What the scheduler does meanwhile: thaw frozen processes when due, replace ended ones."""
        now = time.monotonic()
        for when, who in [t for t in self.thaw if t[0] <= now]:
            os.kill(self.cluster.procs[who].pid, signal.SIGCONT)
            self.frozen.discard(who)
            self.thaw.remove((when, who))
        for name in list(self.cluster.procs):
            code = self.cluster.procs[name].popen.poll()
            if name not in self.ended and code is not None:
                self.ended.add(name)
                self.timeline.append({"t": self.at(), "ended": name, "code": code, "step": self.newest_step()})
                # a thawed one that was replaced already ends too: the job is not grown past its size
                if len([n for n in self.running() if n not in self.frozen]) + len(self.pending) < NODES:
                    self.pending.append(now + self.rng.uniform(*self.replace_after))
        for when in [p for p in self.pending if p <= now]:
            self.pending.remove(when)
            self.start()
            self.timeline.append({"t": self.at(), "started": f"n{len(self.cluster.procs) - 1}"})

    def inject(self, kind: str, freeze: float) -> dict:
        """The fault ``kind`` (one of :data:`FAULTS`) now; returns its timeline record."""
        actives, spares = self.actives(), self.spares()
        victims: list[str] = []
        sig = signal.SIGKILL
        if kind in ("kill-active", "sigterm-active", "freeze-active") and actives:
            victims = [actives[0]]
            sig = {"kill-active": signal.SIGKILL, "sigterm-active": signal.SIGTERM,
                   "freeze-active": signal.SIGSTOP}[kind]
        elif kind == "kill-spare" and spares:
            victims = [spares[0]]
        elif kind == "kill-store-host" and (host := self.store_host()) is not None:
            victims = [host]
        elif kind == "kill-two-actives" and len(actives) >= 2:
            victims = actives[:2]
        record = {"t": self.at(), "fault": kind, "victims": victims, "step": self.newest_step()}
        if len(victims) > 1:
            self.cluster.kill_together(victims)
        for victim in victims if len(victims) == 1 else []:
            os.kill(self.cluster.procs[victim].pid, sig)
            if sig == signal.SIGSTOP:
                self.frozen.add(victim)
                self.thaw.append((time.monotonic() + freeze, victim))
        self.timeline.append(record)
        return record

    def at(self) -> float:
        return round(time.time() - self.started, 2)

    def summary(self, since: float) -> dict:
        """What the job did from ``since`` (its first step, wall clock) on."""
        steps = self.cluster.steps()
        seen: dict[int, int] = {}
        fresh_starts = 0
        for records in steps.values():
            for r in records:
                seen[r["step"]] = seen.get(r["step"], 0) + 1
            if records and records[0]["step"] == 1 and records[0]["t"] > since + 1.0:
                fresh_starts += 1  # a process that trained step 1 after the job had passed it: a second job
        finished_at = max((r["t"] for records in steps.values() for r in records), default=since)
        results = [self.cluster.result(n) for n in self.cluster.procs]
        # the ranks that finished the job (a spare that was never needed reports its untrained weights)
        weights = sorted({json.dumps(r["weights"]) for r in results
                          if r is not None and r.get("rank", -1) >= 0 and r.get("step") == self.max_steps})
        codes = {n: p.popen.poll() for n, p in self.cluster.procs.items()}
        return {"seconds": finished_at - since, "steps": max(seen, default=0), "fresh_starts": fresh_starts,
                "steps_trained_twice": sum(1 for count in seen.values() if count > 2),  # 2 ranks train each once
                "weights": weights, "codes": codes, "left_running": [n for n, c in codes.items() if c is None],
                "timeline": self.timeline}

    def first_step_at(self, timeout: float) -> float:
        """Wait for the job's first step; its wall-clock time."""
        deadline = time.monotonic() + timeout
        while self.newest_step() < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("no step within the timeout:\n" + self.cluster.logs())
            time.sleep(0.1)
        return min(r["t"] for records in self.cluster.steps().values() for r in records)

"""Hand-over and elastic benchmark: SIGTERM to one active node of a running job, and an elastic job that
shrinks and grows back (issue 38).

Three scenarios in real processes on 127.0.0.1 (``tests/scripts/ft_train.py``, ``strategy="ddp_ft"``,
a standalone ``lightning-ft store``), alternating, SIGTERM at the same step:

* ``hand-over``: 2 actives + 1 hot spare; the signalled node hands its place over to the spare
  and the job goes on from the survivor's live state.
* ``elastic``: 1:2 with ``LIGHTNING_FT_ELASTIC=1``, no spare: one node is SIGKILLed, the other
  trains on alone (shrink), then a new participant arrives and is taken in (grow); reported:
  kill -> first step of the shrunk job, and the grow's stall (its ``grow`` event -> the first step
  of the grown job).
* ``stop-relaunch`` (the anchor, what a signal to one node cost before: the whole job stops with
  81 and is requeued): 2 actives, no spare; both stop at the agreed step with their snapshots
  (81) and are relaunched at once on the same nodes -- no scheduler in between, so the anchor is
  a lower bound of a real requeue (minutes of queueing on a cluster); its processes start as
  fresh interpreters, as a scheduler starts them.

Reported: SIGTERM -> the first training step of the job completed after it (``hand-over``: the
survivors' ``first_step_after_recovery`` event; ``stop-relaunch``: the first step record of a
relaunched process), and the steps trained again (the last step before the signal's effect minus
the step training resumed from). The ratio to the anchor in the same run is the result.

    python benchmarks/bench_handover.py [--repeats 3] [--signal-at 40]
"""

from __future__ import annotations

import argparse
import json
import shutil
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
from procs import ProcessSet as FreshProcesses  # noqa: E402  (examples/: no fork server)


def ProcessSet(log_dir: Path) -> FreshProcesses:
    # fresh interpreters, as a scheduler starts them: the relaunch of the anchor pays the real
    # start-up (importing torch and Lightning), not a fork of a preloaded one (tests/prefork.py)
    return FreshProcesses(log_dir, cwd=REPO)

SCENARIOS = ("stop-relaunch", "hand-over", "elastic")


def _train_args(args) -> list[str]:
    return ["--max-steps", str(args.max_steps), "--step-sleep", str(args.step_sleep),
            "--snapshot-every", str(args.snapshot_every), "--resumable-data"]


def hand_over(args, root: Path) -> dict:
    procs = ProcessSet(log_dir=root)
    try:
        cluster = Cluster(procs, root, "2:3", run_id="bench-hand-over")
        cluster.out.mkdir(parents=True)
        cluster.start_store()
        hold = ordered_start(cluster, "AB")
        for infra_rank, name in enumerate("ABC"):
            cluster.start_participant(name, [*_train_args(args), *hold], LIGHTNING_FT_INFRA_RANK=str(infra_rank))
            in_order(cluster, name, actives="AB")
        release(hold)
        cluster.wait_for_step(args.signal_at, 120)
        signalled = cluster.kill("B", signal.SIGTERM)
        codes = cluster.wait(["A", "B", "C"], 120)
        firsts = [e["t"] for e in cluster.events_of("first_step_after_recovery")]
        left_at = max(r["step"] for r in cluster.steps()["B"])
        restored = [e["step"] for e in cluster.events_of("restored") if e.get("round", 0) > 0]
        verdicts = [e["seconds_since_signal"] for e in cluster.events_of("hand_over_verdict") if e["leaving"]]
        return {"seconds": min(firsts) - signalled if firsts else None, "codes": codes,
                "redone": left_at - min(restored) if restored else None,
                "verdict_seconds": verdicts[0] if verdicts else None,
                "finished": all(code == 0 for code in codes.values())}
    finally:
        procs.kill_all()


def elastic(args, root: Path) -> dict:
    procs = ProcessSet(log_dir=root)
    try:
        cluster = Cluster(procs, root, "1:2", run_id="bench-elastic")
        cluster.out.mkdir(parents=True)
        cluster.start_store()
        options = ["--ft-option", "last_call_timeout=60", "--ft-option", "elastic_grow_interval=1"]
        for infra_rank, name in enumerate("AB"):
            cluster.start_participant(name, [*_train_args(args), *options], LIGHTNING_FT_INFRA_RANK=str(infra_rank),
                                      LIGHTNING_FT_ELASTIC="1")
        cluster.wait_for_step(args.signal_at, 120)
        killed = cluster.kill("B")
        cluster.wait_for_log("A", "first step after recovery completed", 120)
        cluster.start_participant("C", [*_train_args(args), *options], LIGHTNING_FT_ELASTIC="1")
        codes = cluster.wait(["A", "C"], 180)
        firsts = sorted(e["t"] for e in cluster.events_of("first_step_after_recovery"))
        grows = [e["t"] for e in cluster.events_of("grow")]
        grown = [t for t in firsts if grows and t > grows[0]]
        return {"seconds": firsts[0] - killed if firsts else None, "codes": codes, "redone": None,
                "verdict_seconds": None, "grow_seconds": grown[0] - grows[0] if grown else None,
                "finished": all(code == 0 for code in codes.values())}
    finally:
        procs.kill_all()


def stop_relaunch(args, root: Path) -> dict:
    procs = ProcessSet(log_dir=root)
    try:
        cluster = Cluster(procs, root, "2:2", run_id="bench-stop")
        cluster.out.mkdir(parents=True)
        cluster.start_store(long_lived=True)
        for infra_rank, name in enumerate("AB"):
            cluster.start_participant(name, _train_args(args), LIGHTNING_FT_INFRA_RANK=str(infra_rank))
        cluster.wait_for_step(args.signal_at, 120)
        signalled = cluster.kill("B", signal.SIGTERM)
        codes = cluster.wait(["A", "B"], 120)
        stopped_at = max(r["step"] for r in cluster.steps()["B"])
        for infra_rank, name in enumerate("AB"):  # the requeue, on the same nodes (identity, memory), at once
            cluster.start_participant(f"{name}2", _train_args(args), LIGHTNING_FT_INFRA_RANK=str(infra_rank),
                                      LIGHTNING_FT_DOMAIN_ID=f"host-{name}",
                                      LIGHTNING_FT_SNAPSHOT_DIR=str(root / f"shm-{name}"))
        deadline = time.monotonic() + 120
        first = None
        while first is None and time.monotonic() < deadline:
            times = [records[0]["t"] for name, records in cluster.steps().items() if name.endswith("2") and records]
            first = min(times) if times else None
            time.sleep(0.02)
        relaunched = cluster.wait(["A2", "B2"], 120)
        resumed = [s["step"] for name in ("A2", "B2") for s in cluster.starts(name)]
        return {"seconds": first - signalled if first is not None else None, "codes": {**codes, "relaunch": relaunched},
                "redone": stopped_at - min(resumed) if resumed else None, "verdict_seconds": None,
                "finished": all(code == 0 for code in relaunched.values())}
    finally:
        procs.kill_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--signal-at", type=int, default=40)
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--snapshot-every", type=int, default=10)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    base = Path(tempfile.mkdtemp(prefix="bench_handover-"))
    try:
        for i in range(args.repeats):
            for name in SCENARIOS:
                run = {"hand-over": hand_over, "elastic": elastic, "stop-relaunch": stop_relaunch}[name]
                outcome = run(args, base / f"{name}-{i}")
                results[name].append(outcome)
                seconds = "never" if outcome["seconds"] is None else f"{outcome['seconds']:.3f}s"
                verdict = "" if outcome["verdict_seconds"] is None else \
                    f", verdict {outcome['verdict_seconds']:.3f}s after the signal"
                grow = "" if outcome.get("grow_seconds") is None else \
                    f", grow: stall {outcome['grow_seconds']:.3f}s"
                cause = "kill" if name == "elastic" else "SIGTERM"
                print(f"run {i} {name:14s}: {cause} -> first step of the job after it {seconds}, steps redone "
                      f"{outcome['redone']}{verdict}{grow}, exit codes {outcome['codes']}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def median(name: str) -> float:
        return statistics.median(r["seconds"] if r["seconds"] is not None else float("inf") for r in results[name])

    anchor, ours, shrunk = median("stop-relaunch"), median("hand-over"), median("elastic")
    stalls = [r["grow_seconds"] for r in results["elastic"] if r.get("grow_seconds") is not None]
    print(f"\nmedian SIGTERM -> first step after it: hand-over {ours:.3f}s (goal <= 1 s), stop + immediate "
          f"relaunch {anchor:.3f}s (ratio {ours / anchor:.2f}x the anchor); steps redone: hand-over "
          f"{[r['redone'] for r in results['hand-over']]}, relaunch {[r['redone'] for r in results['stop-relaunch']]}")
    print(f"elastic: kill -> first step of the shrunk job {shrunk:.3f}s (goal <= 1 s; ratio {shrunk / anchor:.2f}x "
          f"the anchor); grow stall {statistics.median(stalls) if stalls else float('nan'):.3f}s (goal <= 1 s)")
    print(json.dumps({"results": results, "median_hand_over_s": ours, "median_stop_relaunch_s": anchor,
                      "median_elastic_shrink_s": shrunk, "ratio": ours / anchor}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Under a real scheduler: the example batch scripts submitted with sbatch to SLURM on 127.0.0.1.

The session's SLURM (``slurm`` fixture, tests/slurm_cluster.py) has one node with 16 CPUs;
every job has 3 tasks running ``tests/scripts/ft_train.py`` with ``Trainer(strategy="ddp_ft")``
(2 actives + 1 hot spare). On one host the tasks share everything, so each task is given
its own failure domain, snapshot directory and health marker (``task%t`` in the LIGHTNING_FT_*
variables, expanded per task by the script), which models one node per task.

The time from each scenario's event (kill, scancel, signal) to the job's end state is
measured and printed after the run (tests/conftest.py). Scenario (c) waits for slurmctld's
30-s time-limit check, so its job is submitted when the first scenario of its xdist group
starts and checked last.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proc_utils import REPO_ROOT, kill_pids, wait_for
from slurm_cluster import KILL_WAIT, MEASURED, NODE, SlurmCluster, process_environ

pytestmark = [pytest.mark.multiprocess, pytest.mark.slurm]
# Two xdist groups of three scenarios, each on one worker with that worker's own SLURM (the
# session fixture; two clusters on one host do not share anything but munge's binary): the
# scenarios that compare weights with the shared uninterrupted run (``reference``), and the
# others, which run while scenario (c)'s job waits for its time-limit warning. One group of
# six took ~11 minutes on one worker, the suite's longest chain.
WITH_REFERENCE = pytest.mark.xdist_group("slurm-reference")
BESIDE_THE_TIME_LIMIT_JOB = pytest.mark.xdist_group("slurm-time-limit")

DDP_FT_SBATCH = REPO_ROOT / "examples" / "slurm" / "ddp_ft.sbatch"
TORCHRUN_SBATCH = REPO_ROOT / "examples" / "slurm" / "torchrun.sbatch"
TRAIN = REPO_ROOT / "tests" / "scripts" / "ft_train.py"
END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE")
# ~10 s of training at 0.05 s a step; the reference run uses exactly these
STEPS = 150
JOB_STARTUP_ALLOWANCE = 150.0
TIME_LIMIT_STEPS = 200  # scenario (c): attempt 0 at 1 s per step is still training at the warning
TRAIN_ARGS = ["--max-steps", str(STEPS), "--step-sleep", "0.05"]


@dataclass
class Job:
    """One sbatch submission of an example script running ft_train.py."""

    slurm: SlurmCluster
    root: Path
    job_id: str

    @property
    def out(self) -> Path:
        return self.root / "out"

    def output(self) -> str:
        path = self.root / "job.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def info(self) -> dict[str, str]:
        return self.slurm.job(self.job_id)

    def wait_until(self, predicate, timeout: float, what: str) -> dict[str, str]:
        """Poll ``scontrol show job`` until ``predicate(info)``; the info, or an assertion with diagnostics.

        Every 0.25 s for the first 30 s (the scenarios' events end their jobs within that), then
        every second: each poll is an scontrol process and an RPC to slurmctld (about 6 ms of CPU
        in all), and scenario (c) waits minutes for slurmctld's time-limit check."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            info = self.info()
            if predicate(info):
                return info
            now = time.monotonic()
            if now > deadline:
                raise AssertionError(f"job {self.job_id}: {what} did not happen within {timeout:.0f} s; "
                                     f"job: {info}\n{self.diagnostics()}")
            time.sleep(0.25 if now - started < 30 else 1.0)

    def wait_for_end(self, timeout: float) -> dict[str, str]:
        return self.wait_until(lambda i: i.get("JobState") in END_STATES, timeout, "the end")

    def wait_for_requeue(self, timeout: float) -> dict[str, str]:
        return self.wait_until(lambda i: int(i.get("Restarts", "0")) >= 1, timeout, "a requeue")

    def steps(self) -> dict[int, list[dict]]:
        """pid -> its completed-step records."""
        return {int(p.stem.split("-")[1]): _read_jsonl(p) for p in self.out.glob("steps-*.jsonl")}

    def wait_for_step(self, step: int, timeout: float) -> None:
        """Wait until a task reached ``step``: ``timeout`` s of training, after up to
        ``JOB_STARTUP_ALLOWANCE`` s for the job to start and round 0 to form (queueing, srun and
        three processes importing torch take most of a minute on a loaded 2-core machine)."""
        started = wait_for(lambda: self.events(0, "round_complete") or self.steps(), JOB_STARTUP_ALLOWANCE, 0.1)
        assert started, (f"job {self.job_id}: round 0 did not form within {JOB_STARTUP_ALLOWANCE} s\n"
                         f"{self.diagnostics()}")
        ok = wait_for(lambda: any(r and r[-1]["step"] >= step for r in self.steps().values()), timeout, 0.05)
        assert ok, (f"job {self.job_id}: no task reached step {step} within {timeout} s of training\n"
                    f"{self.diagnostics()}")

    def results(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in self.out.glob("result-*.json")]

    def events(self, attempt: int, event: str | None = None) -> list[dict]:
        records = []
        for path in (self.root / "run" / f"attempt-{attempt}" / "events").glob("events-*.jsonl"):
            records += _read_jsonl(path)
        return sorted((r for r in records if event is None or r.get("event") == event), key=lambda r: r["t"])

    def active_domains(self, attempt: int = 0) -> dict[str, int]:
        """Domain (``task<N>``) -> pid of the participants that train in the first round."""
        domains = {e["who"]: e["domain"] for e in self.events(attempt, "join")}
        return {domains[e["who"]]: e["pid"] for e in self.events(attempt, "round_complete")
                if e["round"] == 0 and not e["standby"]}

    def processes(self) -> dict[int, dict[str, str]]:
        """pid -> environment of every process of this job still running (slurmstepd included)."""
        environs = {pid: process_environ(pid) for pid in self.slurm.job_processes()}
        return {pid: env for pid, env in environs.items() if env.get("SLURM_JOB_ID") == self.job_id}

    def task_processes(self, task: str) -> list[int]:
        """The processes of srun task ``task`` (SLURM_PROCID): what dies with its node, slurmstepd aside."""
        return [pid for pid, env in self.processes().items()
                if env.get("SLURM_PROCID") == task and "SLURM_STEPID" in env and "slurmstepd" not in _cmdline(pid)]

    def srun_and_job_codes(self) -> list[tuple[int, int]]:
        """(srun's code, the job's code) of each attempt, from the script's last line."""
        lines = [line for line in self.output().splitlines() if "; job exits " in line]
        return [(int(line.split("srun exited ")[1].split(";")[0]), int(line.rsplit(" ", 1)[1])) for line in lines]

    def diagnostics(self) -> str:
        events = "\n".join(json.dumps(e) for a in range(3) for e in self.events(a))
        return (f"===== job output =====\n{self.output()[-8000:]}\n===== events =====\n{events[-6000:]}\n"
                f"===== node =====\n{self.slurm.node()}")


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@dataclass
class Jobs:
    """Submits jobs for one test and cancels whatever is left of them at its end."""

    slurm: SlurmCluster
    tmp_path: Path
    submitted: list[Job] = field(default_factory=list)

    def submit(self, name: str, train_args: list[str], options: tuple[str, ...] = ("--ntasks=3",),
               script: Path = DDP_FT_SBATCH) -> Job:
        root = self.tmp_path / name
        root.mkdir(parents=True)
        environment = {
            "PYTHON": sys.executable, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",  # three training processes share two cores
            "FT_RUN_DIR": str(root / "run"),
            # one "node" per task on this host: own failure domain, snapshot directory, health marker
            "LIGHTNING_FT_DOMAIN_ID": "task%t",
            "LIGHTNING_FT_STRAGGLER_FACTOR": "off",  # the tasks share two cores (see tests/proc_utils.py)
            "LIGHTNING_FT_SNAPSHOT_DIR": f"{root}/shm/task%t",
            "LIGHTNING_FT_HEALTH_MARKERS": f"{self.slurm.root}/markers/%j/unhealthy-task%t",
            "LIGHTNING_FT_GRACE_SECONDS": str(KILL_WAIT),
        }
        args = [str(TRAIN), "--out", str(root / "out"), "--ft-by-name", "--quiet", "--resumable-data", *train_args]
        job_id = self.slurm.sbatch(script, args, [f"--job-name={name}", f"--output={root}/job.out",
                                                 f"--chdir={root}", *options], environment)
        job = Job(self.slurm, root, job_id)
        self.submitted.append(job)
        return job

    def cancel_all(self) -> None:
        for job in self.submitted:
            if job.info().get("JobState") not in END_STATES:
                self.slurm.scontrol_quiet(["scancel", "--full", "--signal=KILL", job.job_id])
                self.slurm.scontrol_quiet(["scancel", job.job_id])


@pytest.fixture
def jobs(slurm, tmp_path):
    jobs = Jobs(slurm, tmp_path)
    try:
        yield jobs
    finally:
        jobs.cancel_all()


@pytest.fixture
def timings(request):
    """Scenario -> seconds from its event to the job's end state; conftest prints them after the run.

    They travel with the test's report (``user_properties``): under pytest-xdist the test runs
    in a worker process and the summary is printed by the controller.
    """
    measured: dict[str, float] = {}
    yield measured
    MEASURED.update(measured)
    request.node.user_properties.extend(("slurm_timing", item) for item in measured.items())


@dataclass
class Reference:
    """An uninterrupted run with TRAIN_ARGS, submitted once and shared (its weights are the yardstick)."""

    job: Job

    def weights(self) -> list[float]:
        info = self.job.wait_for_end(120)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), self.job.diagnostics()
        trained = [r for r in self.job.results() if r["trained"]]
        assert [r["step"] for r in trained] == [STEPS, STEPS], self.job.diagnostics()
        return trained[0]["weights"]


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    jobs = Jobs(slurm, tmp_path_factory.mktemp("slurm-reference"))
    # another layout on purpose: one node, --ntasks-per-node (the other jobs use --ntasks)
    yield Reference(jobs.submit("reference", TRAIN_ARGS, options=("--nodes=1", "--ntasks-per-node=3")))
    jobs.cancel_all()


@pytest.fixture(scope="module")
def time_limit_job(slurm, tmp_path_factory):
    """The job of scenario (c), submitted when the first scenario of its group starts: most of
    it is waiting for slurmctld's time-limit check, which can as well happen while (e) and (f) run.

    ``--time=3``, warning 10 s before: slurmctld checks limits every 30 s and sends the warning
    at the first check within 10 + 30 s of the limit, i.e. 140..170 s after the start; the limit
    itself is enforced at the first check after it, >= 30 s after the warning. (With
    ``--time=2`` the warning came 80..110 s after the start, and once, with the whole suite
    running at a load average of 7 on 2 cores, before three tasks importing torch had joined:
    they were stopped before anything trained, truthfully 143, which is not this scenario.)
    Attempt 0 trains slowly enough (200 steps of 1 s) to be still running at the warning
    however fast it starts; the requeued attempt fast.
    """
    jobs = Jobs(slurm, tmp_path_factory.mktemp("slurm-time-limit"))
    job = jobs.submit("time-limit", ["--max-steps", str(TIME_LIMIT_STEPS), "--step-sleep", "1.0",
                                     "--step-sleep-requeued", "0.02"],
                      options=("--ntasks=3", "--time=3", "--signal=B:USR1@10"))
    stop = threading.Event()

    def give_the_rerun_time() -> None:
        # the requeued run would get the same short limit again (and another warning); a real job's rerun
        # has its whole time limit. Raised while the job waits for its restart (>= cred_expire, 5 s).
        while not stop.wait(1.0):
            if int(job.info().get("Restarts", "0")) >= 1:
                slurm.run(["scontrol", "update", f"jobid={job.job_id}", "TimeLimit=10"])
                return

    watcher = threading.Thread(target=give_the_rerun_time, name="time-limit-watcher", daemon=True)
    watcher.start()
    yield job
    stop.set()
    watcher.join(timeout=10)
    jobs.cancel_all()


def ended_after(job: Job, start: float, timeout: float) -> tuple[dict[str, str], float]:
    """Wait for the job's end state; (its info, seconds since ``start`` (time.monotonic()) when seen)."""
    info = job.wait_for_end(timeout)
    return info, time.monotonic() - start


# ---------------------------------------------------------------------------- scenarios


@WITH_REFERENCE
@pytest.mark.timeout(330)
def test_a_sigkilled_task_is_replaced_by_the_spare_and_the_job_completes_0(jobs, reference, timings):
    """The killed task is the one that hosts the rendezvous store (task 0; the batch step holds
    nothing the tasks need): the store fails over to a surviving task, the spare steps in
    (issue 25), and the task's restart loop starts its participant again: it rejoins the running
    job as a spare (issue 45) -- it does not host a store at the job's endpoint."""
    job = jobs.submit("sigkill", TRAIN_ARGS)
    job.wait_for_step(40, 90)
    # the spare joined the store before its host dies (one that starts later cannot find the job)
    assert wait_for(lambda: any(e["standby"] for e in job.events(0, "round_complete")), 60), job.diagnostics()
    hosts = {e["pid"] for e in job.events(0, "join") if e["store_host"]}
    actives = set(job.active_domains().values())
    assert len(hosts) == 1 and hosts <= actives, (hosts, actives, job.diagnostics())
    victim = hosts.pop()
    start = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    info, seconds = ended_after(job, start, 90)
    timings["(a) SIGKILL of the active task that hosts the store -> COMPLETED"] = seconds
    assert job.events(0, "store_failover"), job.diagnostics()

    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.diagnostics()
    # the task restarted its crashed participant (the batch script's loop): it rejoined the running job
    # as a spare -- or, started after the job's end (a fresh interpreter takes seconds on a loaded
    # machine), found no running job -- and left 0, never hosting a store or training: srun reports 0
    # (without the loop: 137, the highest task code)
    output = job.output()
    assert "restart 1 of 3" in output, job.diagnostics()
    assert "rejoining the running job" in output or "there is no running job to rejoin" in output, job.diagnostics()
    again = [e for e in job.events(0, "join") if e["pid"] != victim and e["domain"] == _domain_of(job, 0, victim)]
    assert not any(e["store_host"] for e in again), job.diagnostics()
    assert job.srun_and_job_codes() == [(0, 0)], job.diagnostics()
    assert job.events(0, "snapshot_received"), "the spare did not receive the snapshot"
    trained = [r for r in job.results() if r["trained"]]
    assert [r["step"] for r in trained] == [STEPS, STEPS], job.diagnostics()
    for result in trained:  # recovery from the snapshot is exact
        assert result["weights"] == reference.weights()


@WITH_REFERENCE
@pytest.mark.timeout(390)
def test_b_scancel_signal_term_stops_at_one_step_with_81_and_slurm_requeues_and_resumes(jobs, reference, timings):
    job = jobs.submit("term-requeue", TRAIN_ARGS)
    job.wait_for_step(40, 90)
    start = time.monotonic()
    job.slurm.scancel(job.job_id, "--signal=TERM")
    job.wait_for_requeue(60)
    requeued = time.monotonic() - start
    info, seconds = ended_after(job, start, 150)
    timings["(b) scancel --signal=TERM -> requeued (81)"] = requeued
    timings["(b) scancel --signal=TERM -> COMPLETED after the requeue"] = seconds

    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.diagnostics()
    # srun returns the highest task code: the hot spare, stopped with nothing of its own to
    # save, exits 143; the job's code comes from the run's outcome (both ranks saved: 81)
    assert job.srun_and_job_codes() == [(143, 81), (0, 0)], job.diagnostics()
    decisions = job.events(0, "termination_decision")
    assert [d["exit_code"] for d in decisions] == [81, 81], job.diagnostics()
    stop_step = decisions[0]["step"]
    assert decisions[1]["step"] == stop_step  # every rank stopped after the same step
    # the requeued run resumed at that step from the in-memory snapshots (same node)
    restored = job.events(1, "restored")
    assert restored and {e["step"] for e in restored} == {stop_step}, job.diagnostics()
    trained = [r for r in job.results() if r["trained"]]
    assert [r["step"] for r in trained] == [STEPS, STEPS], job.diagnostics()
    for result in trained:
        assert result["weights"] == reference.weights()


@WITH_REFERENCE
@pytest.mark.timeout(390)
def test_d_unhealthy_node_exits_82_the_job_ends_82_the_epilog_drains_the_node(jobs, slurm, reference, timings):
    job = jobs.submit("unhealthy", TRAIN_ARGS)
    job.wait_for_step(30, 90)
    domain, _ = sorted(job.active_domains().items())[-1]
    marker = slurm.markers(job.job_id) / f"unhealthy-{domain}"
    marker.write_text("test: this node's disk is failing")
    try:
        start = time.monotonic()
        slurm.scancel(job.job_id, "--signal=TERM")
        info = job.wait_for_requeue(60)
        # requeued through RequeueExit=82; the Epilog found the marker and drained the node, so
        # the job cannot start on it again
        assert wait_for(lambda: "DRAIN" in slurm.node_state(), 30), job.diagnostics()
        timings["(d) SIGTERM on an unhealthy node -> 82, requeued, node drained"] = time.monotonic() - start
        node = slurm.node()
        info = job.info()
        assert info["JobState"] == "PENDING" and info["ExitCode"] == "82:0", (info, job.diagnostics())
        assert "Epilog error" in node.get("Reason", ""), node
        assert job.srun_and_job_codes() == [(143, 82)], job.diagnostics()  # 143: the stopped spare (see (b))
        [unhealthy] = job.events(0, "unhealthy_exit")
        assert unhealthy["exit_code"] == 82 and any(domain in reason for reason in unhealthy["reasons"])
        saved = job.events(0, "termination_decision")
        assert [d["exit_code"] for d in saved] == [81], job.diagnostics()  # the healthy peer saved
        # the repair: the marker goes, the administrator resumes the node; the requeued job runs
        marker.unlink()
        slurm.run(["scontrol", "update", f"nodename={NODE}", "state=resume"])
        info, seconds = ended_after(job, start, 120)
        timings["(d) SIGTERM -> COMPLETED (the test resumes the node once drained)"] = seconds
    finally:
        marker.unlink(missing_ok=True)
        if "DRAIN" in slurm.node_state():
            slurm.run(["scontrol", "update", f"nodename={NODE}", "state=resume"])
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.diagnostics()
    # The healthy peer alone saved the stop step. The rerun resumes from the newest snapshot its
    # *active* participants hold: the stop step when that peer is active again; when it arrived
    # too late and waits as the spare, an older periodic one (a spare's snapshot is not used).
    stop_step = saved[0]["step"]
    saver = _domain_of(job, 0, saved[0]["pid"])
    restored = {e["step"] for e in job.events(1, "restored")}
    if saver in job.active_domains(1):
        assert restored == {stop_step}, job.diagnostics()
    else:
        [step] = restored
        assert 0 < step <= stop_step and step % 10 == 0, job.diagnostics()
    trained = [r for r in job.results() if r["trained"]]
    assert [r["step"] for r in trained] == [STEPS, STEPS], job.diagnostics()
    for result in trained:  # whichever it was, the resumed state was exact
        assert result["weights"] == reference.weights()


@BESIDE_THE_TIME_LIMIT_JOB
@pytest.mark.usefixtures("time_limit_job")  # submitted now, checked by (c)
@pytest.mark.timeout(330)
def test_e_plain_scancel_ends_within_kill_wait_with_a_truthful_code_and_full_is_a_kill(jobs, slurm, timings):
    from lightning_ft.report.timeline import job_exit_code, summarize

    # two jobs at once: plain scancel (SIGTERM to every process of the job, SIGKILL KillWait later)
    # and scancel --signal=TERM --full (SIGTERM to the batch step only, srun included)
    plain = jobs.submit("scancel", ["--max-steps", "2000", "--step-sleep", "0.05"])
    full = jobs.submit("scancel-full", ["--max-steps", "2000", "--step-sleep", "0.05"])
    for job in (plain, full):
        job.wait_for_step(30, 90)
    start = time.monotonic()
    slurm.scancel(plain.job_id)
    slurm.scancel(full.job_id, "--signal=TERM", "--full")
    info, seconds = ended_after(plain, start, KILL_WAIT + 60)
    timings["(e) plain scancel -> CANCELLED"] = seconds
    full_info, seconds = ended_after(full, start, 60)
    timings["(e) scancel --signal=TERM --full -> FAILED"] = seconds

    for job, job_info in ((plain, info), (full, full_info)):
        assert job_info["Restarts"] == "0", job.diagnostics()
        # the script ran to its end (no SIGKILL after KillWait) and said what the events say
        [(srun_code, job_code)] = job.srun_and_job_codes()
        assert f"{job_code}:0" == job_info["ExitCode"], (job_info, job.diagnostics())
        expected = job_exit_code(summarize(job.events(0)), srun_code)
        assert job_code == expected.code, (expected, job.diagnostics())
        assert not job.processes(), "processes of the job are left"
    # plain scancel: every rank stopped at one step and saved; the job is cancelled, not requeued
    assert info["JobState"] == "CANCELLED" and info["ExitCode"] == "81:0", plain.diagnostics()
    assert [d["exit_code"] for d in plain.events(0, "termination_decision")] == [81, 81], plain.diagnostics()
    # --full: srun turned its SIGTERM into SIGKILL of its tasks, which never saw a signal: nothing
    # was saved at a stop, and the job says so (137, FAILED, not requeued)
    assert (full_info["JobState"], full_info["ExitCode"]) == ("FAILED", "137:0"), full.diagnostics()
    assert not full.events(0, "termination_signal"), full.diagnostics()


@BESIDE_THE_TIME_LIMIT_JOB
@pytest.mark.usefixtures("time_limit_job")  # submitted now, checked by (c)
@pytest.mark.timeout(390)
def test_f_torchrun_script_survives_a_killed_node_and_completes_0(jobs, timings):
    # the script asks for one task per node on 3 nodes; this cluster has one node with 3 "nodes" on it
    job = jobs.submit("torchrun", TRAIN_ARGS, options=("--nodes=1", "--ntasks-per-node=3"), script=TORCHRUN_SBATCH)
    job.wait_for_step(40, 120)
    worker = max(pid for pid, records in job.steps().items() if records)
    node = job.task_processes(process_environ(worker)["SLURM_PROCID"])
    assert worker in node
    start = time.monotonic()
    kill_pids(node)  # the whole "node": exit-code wrapper, torchrun agent, worker
    info, seconds = ended_after(job, start, 120)
    timings["(f) torchrun: SIGKILL of a node -> COMPLETED"] = seconds

    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.diagnostics()
    [(srun_code, job_code)] = job.srun_and_job_codes()
    assert srun_code != 0 and job_code == 0, job.diagnostics()
    assert job.events(0, "snapshot_received"), job.diagnostics()
    finished = job.events(0, "finished")
    assert sorted(e["step"] for e in finished) == [STEPS, STEPS], job.diagnostics()



@BESIDE_THE_TIME_LIMIT_JOB
@pytest.mark.usefixtures("time_limit_job")  # submitted now, checked by (c)
@pytest.mark.timeout(330)
def test_g_sigterm_to_one_task_hands_over_to_the_spare_and_the_job_completes_0(jobs, timings):
    """Issue 38: SIGTERM reaches one active task (a node's notice: a spot reclaim, a drain agent; on
    this one-node cluster ``scancel --signal`` would reach every task of the step): it hands its
    place over to the hot spare and exits 0, the job goes on and ends COMPLETED 0:0 -- srun's own
    code 0 too, no task failed."""
    job = jobs.submit("hand-over", TRAIN_ARGS)
    job.wait_for_step(40, 90)
    assert wait_for(lambda: any(e["standby"] for e in job.events(0, "round_complete")), 60), job.diagnostics()
    hosts = {e["pid"] for e in job.events(0, "join") if e["store_host"]}
    victim = next(pid for pid in job.active_domains().values() if pid not in hosts)
    start = time.monotonic()
    os.kill(victim, signal.SIGTERM)
    info, seconds = ended_after(job, start, 120)
    timings["(g) SIGTERM to one active task -> hand-over -> COMPLETED"] = seconds

    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.diagnostics()
    assert job.srun_and_job_codes() == [(0, 0)], job.diagnostics()
    [handed] = job.events(0, "handed_over")
    assert handed["pid"] == victim, job.diagnostics()
    assert job.events(0, "snapshot_received"), "the spare did not receive the live state"
    finished = job.events(0, "finished")
    assert sorted(e["step"] for e in finished) == [STEPS, STEPS], job.diagnostics()
    restored = {e["step"] for e in job.events(0, "restored") if e.get("round", 0) > 0}
    assert restored == {handed["step"]}, (restored, handed)  # no step trained again


@BESIDE_THE_TIME_LIMIT_JOB
@pytest.mark.timeout(420)
def test_c_time_limit_warning_stops_and_saves_before_the_limit_then_requeue_completes(time_limit_job, timings):
    job = time_limit_job  # submitted when the first scenario of this group started (see the fixture)
    info = job.wait_for_end(360)
    signalled = job.events(0, "termination_signal")
    assert signalled, job.diagnostics()
    ended = datetime.datetime.fromisoformat(info["EndTime"]).timestamp()
    timings["(c) time-limit warning (B:USR1) -> COMPLETED after the requeue"] = ended - signalled[0]["t"]

    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.diagnostics()
    output = job.output()
    assert "time limit near: SIGTERM to the tasks" in output
    assert "ddp_ft.sbatch: SIGTERM" not in output, "the limit itself was reached (SLURM's own SIGTERM)"
    assert job.srun_and_job_codes() == [(143, 81), (0, 0)], job.diagnostics()  # 143: the spare (see (b))
    decisions = job.events(0, "termination_decision")
    assert [d["exit_code"] for d in decisions] == [81, 81], job.diagnostics()
    stop_step = decisions[0]["step"]
    assert {e["step"] for e in job.events(1, "restored")} == {stop_step}, job.diagnostics()
    assert [r["step"] for r in job.results() if r["trained"]] == [TIME_LIMIT_STEPS] * 2, job.diagnostics()


def _domain_of(job: Job, attempt: int, pid: int) -> str:
    return next(e["domain"] for e in job.events(attempt, "join") if e["pid"] == pid)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


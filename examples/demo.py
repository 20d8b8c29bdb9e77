"""lightning_ft demo: a fine-tuning job survives a SIGKILLed node, on this machine, in under a minute.

    python examples/demo.py                  # from the repository root

What it does:

1. makes a job secret (a new random one in a 0600 file, as a launcher would: docs/trust.md),
   starts a rendezvous store (``lightning-ft store``) and three participants with it, each a
   separate process with its own node identity (domain, snapshot directory, log):
   two train with ``Trainer(strategy="ddp_ft")``, the third waits as a hot spare;
2. once training passed a mid-run step, SIGKILLs one of the two training participants;
3. the survivor and the spare re-form the group and resume from the newest in-memory
   snapshot, inside the same ``fit()`` call; nothing is relaunched;
4. prints the final metric and the recovery timeline (``lightning-ft report``), and exits
   0 only if the run finished every step with exactly the expected exit codes.

Every process it starts is killed (by pid) when it ends, also on Ctrl-C or a timeout.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lightning_ft from this checkout, installed or not
from lightning_ft.events import EventLog, read_events
from lightning_ft.events.names import JOIN, ROUND_COMPLETE
from lightning_ft.report.text import format_report
from lightning_ft.report.timeline import summarize

import common  # this directory is on sys.path when the demo runs as a script
from procs import Proc, ProcessSet, free_port, write_secret

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
EXAMPLES = {"transformer": "finetune_transformer.py", "mlp": "finetune_mlp.py"}
NODES = ("node-a", "node-b", "node-c")
RUN_ID = "demo"
PROGRESS = re.compile(r"^\[rank (\d+)/(\d+)\] step (\d+)/(\d+)", re.MULTILINE)


class DemoFailed(Exception):
    """The run did not do what the demo promises; the message says what went wrong."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="demo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--example", choices=sorted(EXAMPLES), default="transformer",
                        help="which fine-tuning example the participants run (default transformer)")
    parser.add_argument("--max-steps", type=common.positive_int, default=200, help="training steps (default 200)")
    parser.add_argument("--kill-at-step", type=common.positive_int, default=None,
                        help="SIGKILL a training participant once this step is reached (default: 40%% of the run)")
    parser.add_argument("--kill-rank", type=int, choices=(0, 1), default=1,
                        help="rank of the participant to kill (default 1)")
    parser.add_argument("--timeout", type=common.positive_float, default=150.0,
                        help="hard deadline for the whole demo in seconds (default 150)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory (logs, events) afterwards")
    args = parser.parse_args(argv)
    if args.kill_at_step is None:
        args.kill_at_step = max(1, args.max_steps * 2 // 5)
    if args.kill_at_step >= args.max_steps:
        parser.error(f"--kill-at-step {args.kill_at_step} must be below --max-steps {args.max_steps}")
    return args


# ---------------------------------------------------------------------- processes

def base_env() -> dict[str, str]:
    """Our environment minus anything that would make a child think it is part of another job."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "LIGHTNING_FT_", "PL_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_WORLD_SIZE", "JOB_COMPLETION_INDEX", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # three processes share a small machine
    env["LIGHTNING_FT_LOG_LEVEL"] = "WARNING"
    # the demo's "nodes" share this machine: one slowed by the others is no straggler of its own
    env["LIGHTNING_FT_STRAGGLER_FACTOR"] = "off"
    return env


# ---------------------------------------------------------------------- pure helpers

def latest_progress(log_text: str) -> tuple[int, int, int] | None:
    """(rank, world, step) of the last progress line of a participant, or None."""
    matches = PROGRESS.findall(log_text)
    if not matches:
        return None
    rank, world, step, _ = matches[-1]
    return int(rank), int(world), int(step)


def standing_by(events: list[dict]) -> list[str]:
    """Participants (by domain, which the demo names node-a/b/c) whose latest completed round
    made them a hot spare (``standby``)."""
    domain_of: dict[str, str] = {}
    latest: dict[str, bool] = {}
    for event in events:
        if event.get("event") == JOIN:
            domain_of[event.get("who", "")] = event.get("domain", "")
        elif event.get("event") == ROUND_COMPLETE:
            latest[domain_of.get(event.get("who", ""), "")] = bool(event.get("standby"))
    return sorted(name for name, standby in latest.items() if standby and name in NODES)


def final_lines(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if line.startswith("FINAL ")]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed ({signal.Signals(-code).name})"
    return f"exit {code}"


# ---------------------------------------------------------------------- the demo

class Demo:
    def __init__(self, args: argparse.Namespace, run_dir: Path, shm_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.shm_dir = shm_dir
        self.events_dir = run_dir / "events"
        self.processes = ProcessSet(run_dir, cwd=REPO_ROOT)
        # the store and every participant share it: store values are sealed, replicas encrypted
        self.secret = {"LIGHTNING_FT_SECRET_FILE": write_secret(run_dir)}
        self.started = time.monotonic()
        self.deadline = self.started + args.timeout

    def say(self, text: str) -> None:
        print(f"  [{time.monotonic() - self.started:5.1f}s] {text}", flush=True)

    def remaining(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DemoFailed(f"the {self.args.timeout:g} s deadline passed while {what}")
        return left

    def wait_until(self, what: str, condition, interval: float = 0.1):
        while True:
            self.remaining(what)
            value = condition()
            if value:
                return value
            time.sleep(interval)

    def participants(self) -> dict[str, Proc]:
        return {name: proc for name, proc in self.processes.procs.items() if name in NODES}

    def start_store(self, port: int) -> Proc:
        store = self.processes.start(
            "store", [sys.executable, "-m", "lightning_ft.cli", "store", "--host", "127.0.0.1", "--port", str(port),
                      "--run-id", RUN_ID], {**base_env(), **self.secret})

        def listening():
            if store.popen.poll() is not None:
                raise DemoFailed(f"the store exited with {store.popen.returncode}:\n{store.log()}")
            return "listening" in store.log()

        self.wait_until("starting the store", listening, 0.05)
        return store

    def start_participants(self, port: int) -> None:
        script = str(HERE / EXAMPLES[self.args.example])
        for name in NODES:
            env = {**base_env(), **self.secret}
            env.update(LIGHTNING_FT_ENDPOINT=f"127.0.0.1:{port}", LIGHTNING_FT_RUN_ID=RUN_ID,
                       LIGHTNING_FT_NNODES="2:3", LIGHTNING_FT_DOMAIN_ID=name,
                       LIGHTNING_FT_SNAPSHOT_DIR=str(self.shm_dir / name),
                       LIGHTNING_FT_EVENTS_DIR=str(self.events_dir))
            # one of them pretrains, the others load its result (as a job loads a downloaded checkpoint)
            self.processes.start(name, [sys.executable, script, "--strategy", "ddp_ft", "--pretrained",
                                        str(self.run_dir / "pretrained.pt"), "--max-steps",
                                        str(self.args.max_steps), "--progress-every", "10"], env)

    def check_nobody_died(self, expected_dead: set[str] = frozenset()) -> None:
        for name, proc in self.participants().items():
            code = proc.popen.poll()
            if code is not None and code != 0 and name not in expected_dead:
                raise DemoFailed(f"{name} exited early ({describe_exit(code)})")

    def run(self) -> int:
        args = self.args
        print(f"lightning_ft demo: 2 training participants + 1 hot spare run {EXAMPLES[args.example]} "
              f"({args.max_steps} steps);\n  one of them is SIGKILLed at step {args.kill_at_step}. "
              f"Logs and events go to {self.run_dir}" + (" (deleted at the end without --keep)" if not args.keep
                                                         else ""), flush=True)
        port = free_port()
        store = self.start_store(port)
        self.say(f"rendezvous store (pid {store.pid}) listening on 127.0.0.1:{port}")
        self.start_participants(port)
        pids = ", ".join(f"{name} (pid {proc.pid})" for name, proc in self.participants().items())
        self.say(f"started {pids}; they prepare the model, then meet in the rendezvous")

        def progress():
            self.check_nobody_died()
            return {name: p for name, proc in self.participants().items() if (p := latest_progress(proc.log()))}

        first = self.wait_until("waiting for training to start", progress)
        roles = ", ".join(f"{name} is rank {p[0]}" for name, p in sorted(first.items(), key=lambda kv: kv[1][0]))
        self.say(f"training: {roles}")

        # the kill shows a hot spare stepping in only when one stands by: on a loaded machine
        # the third participant can still be importing when the other two start training
        # (the round closes with min_nodes), so wait for its own word, not for its silence
        def spare_standing_by():
            progress()
            spares = standing_by(read_events(self.events_dir))
            if not spares and any(self.processes.procs[name].popen.poll() is not None for name in first):
                raise DemoFailed("training ended before the third participant stood by as a hot spare")
            return spares

        spares = self.wait_until("waiting for the hot spare to stand by", spare_standing_by)
        self.say(f"{', '.join(spares)} waits as hot spare")

        def reached_kill_step():
            now = progress()
            return now if any(p[2] >= args.kill_at_step for p in now.values()) else None

        now = self.wait_until(f"waiting for step {args.kill_at_step}", reached_kill_step, 0.05)
        victims = [name for name, p in now.items() if p[0] == args.kill_rank and p[1] == 2]
        if not victims:
            raise DemoFailed(f"no participant reports rank {args.kill_rank} of 2: {now}")
        victim = victims[0]
        victim_proc = self.processes.procs[victim]
        step = max(p[2] for p in now.values())
        os.kill(victim_proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # the victim cannot log its own death; put it on the run's timeline for the report
        EventLog(self.events_dir, "demo").emit("sigkill", target=victim, target_pid=victim_proc.pid, step=step)
        self.say(f"step {step} reached: SIGKILL {victim} (rank {args.kill_rank}, pid {victim_proc.pid})")

        def recovered():
            self.check_nobody_died({victim})
            return next((e for e in read_events(self.events_dir) if e.get("event") == "first_step_after_recovery"),
                        None)

        event = self.wait_until("waiting for the recovery", recovered, 0.1)
        restored = latest_restored_step(self.events_dir)
        # the survivor may have finished the step it was in before the kill landed: say the step
        # the failure was detected at, as the report does
        detected = [e.get("step") for e in read_events(self.events_dir) if e.get("event") == "failure_detected"]
        at = f"failure detected at step {max(detected)}; " if detected and None not in detected else ""
        self.say(f"recovered: {at}training continues from the snapshot of step {restored} "
                 f"({time.monotonic() - killed_at:.1f} s after the kill, first step done {event.get('step')})")

        survivors = {name: proc for name, proc in self.participants().items() if name != victim}

        def all_exited():
            for name, proc in survivors.items():
                code = proc.popen.poll()
                if code is not None and code != 0:
                    raise DemoFailed(f"{name} ended with {describe_exit(code)}")
            return all(proc.popen.poll() is not None for proc in survivors.values())

        self.wait_until("waiting for the run to finish", all_exited, 0.1)
        codes = ", ".join(f"{name} {describe_exit(proc.popen.poll())}" for name, proc in self.participants().items())
        self.say(f"all participants ended: {codes}")
        return self.verify_and_report(victim, survivors)

    def verify_and_report(self, victim: str, survivors: dict[str, Proc]) -> int:
        finals = [(name, line) for name, proc in survivors.items() for line in final_lines(proc.log())]
        if len(finals) != 1:
            raise DemoFailed(f"expected one FINAL line from the participants, got {len(finals)}: {finals}")
        name, line = finals[0]
        if f" step={self.args.max_steps} " not in line:
            raise DemoFailed(f"the run did not reach step {self.args.max_steps}: {line}")
        summary = summarize(read_events(self.events_dir))
        if summary.status != "finished":
            raise DemoFailed(f"the event log does not show a finished run: {summary.status_detail}")
        if not summary.failures or not all(f.recovered for f in summary.failures):
            raise DemoFailed("the event log does not show the failure and its recovery")
        print(f"\n{line}\n  (printed by {name}, rank 0 at the end)\n", flush=True)
        print(format_report(summary), flush=True)
        lost = summary.failures[0]
        goodput = "" if summary.goodput is None else f" (goodput {100 * summary.goodput:.1f} %)"
        print(f"\nOK: the run lost {victim} at step {lost.failure_step}, recovered in "
              f"{lost.recovery_seconds:.1f} s redoing {lost.steps_redone} step(s), and finished all "
              f"{self.args.max_steps} steps{goodput}; {time.monotonic() - self.started:.1f} s in total.", flush=True)
        if self.args.keep:
            print(f"Logs: {self.run_dir}/*.log; timeline again: lightning-ft report {self.events_dir}", flush=True)
        return 0

    def dump_logs(self) -> None:
        for name, proc in self.processes.procs.items():
            tail = "\n".join(proc.log().splitlines()[-25:])
            print(f"----- {name} (pid {proc.pid}, {describe_exit(proc.popen.poll())}), last lines of "
                  f"{proc.log_path} -----\n{tail}", file=sys.stderr)


def latest_restored_step(events_dir: Path) -> int | None:
    steps = [e.get("step") for e in read_events(events_dir) if e.get("event") == "restored"]
    return steps[-1] if steps else None


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `kill -USR1 <pid>` prints where every thread of the demo is (to see a demo that hangs)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C stops the demo even when it was started with SIGINT ignored (Python then leaves
    # it ignored): a background job of a non-interactive shell, or a test runner's worker
    signal.signal(signal.SIGINT, signal.default_int_handler)
    run_dir = Path(tempfile.mkdtemp(prefix="lightning_ft_demo_"))
    shm_parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # snapshots live in shared memory
    shm_dir = Path(tempfile.mkdtemp(prefix="lightning_ft_demo_", dir=shm_parent))
    demo = Demo(args, run_dir, shm_dir)
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # clean up on SIGTERM as on Ctrl-C
    keep = args.keep
    try:
        return demo.run()
    except DemoFailed as exc:
        demo.dump_logs()
        print(f"\nFAILED: {exc}\n  logs and events kept in {run_dir}", file=sys.stderr)
        keep = True
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process the demo started", file=sys.stderr)
        return 130
    finally:
        demo.processes.kill_all()
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(shm_dir, ignore_errors=True)
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

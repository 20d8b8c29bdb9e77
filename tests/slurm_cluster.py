"""A real single-node SLURM on 127.0.0.1 for the tests: munged, slurmctld and slurmd.

Everything lives in one temporary directory: the munge key and socket, ``slurm.conf``, state,
spool, logs. Nothing goes to /etc; clients find the cluster through ``SLURM_CONF``. The
daemons run in the foreground as children of the test process, each in its own session, and
are stopped by pid. Job processes (slurmstepd, batch scripts, tasks) are not our children
(slurmstepd daemonizes): they are found by the ``SLURM_CONF`` of this cluster in their
environment and killed by pid as well.

SLURM itself is Debian's ``slurm-wlm`` (22.05) + ``munge``; :func:`ensure_installed` installs
them with apt when ``slurmctld`` is missing (root and Debian's package index are needed).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from proc_utils import REPO_ROOT, kill_pids, wait_for

PACKAGES = ("slurm-wlm", "munge")
COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")
NODE = "localhost"
KILL_WAIT = 10  # SIGTERM -> SIGKILL at scancel/time limit, seconds
EPILOG = REPO_ROOT / "examples" / "slurm" / "epilog.sh"
#: scenario -> seconds from its event to the job's end state, measured by the tests, printed at the end
MEASURED: dict[str, float] = {}


class SlurmUnavailable(RuntimeError):
    """SLURM could not be installed or started; the message says why."""


def missing_commands() -> list[str]:
    return [name for name in COMMANDS if shutil.which(name) is None]


_INSTALL_LOCK = Path(tempfile.gettempdir()) / "lightning_ft-slurm-install.lock"
_DPKG_LOCK_WAIT_S = 300


def ensure_installed(log: Path) -> None:
    """Install Debian's slurm-wlm and munge with apt-get unless their commands are all there."""
    if not missing_commands():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"SLURM is not installed ({', '.join(missing_commands())} missing) and the tests "
                               "are not root, so they cannot install it: apt-get install slurm-wlm munge")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("SLURM is not installed and there is no apt-get to install slurm-wlm and munge")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # apt waits for another dpkg user (e.g. unattended upgrades on a fresh machine) instead of failing
    wait_for_dpkg = ["-o", f"DPkg::Lock::Timeout={_DPKG_LOCK_WAIT_S}"]
    install = ["apt-get", *wait_for_dpkg, "install", "-y", "-q", *PACKAGES]
    # one installer at a time among this machine's test processes (pytest-xdist workers): the
    # second one finds the commands there once the first is done
    with open(_INSTALL_LOCK, "a") as lock, open(log, "ab") as out:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not missing_commands():
            return
        # a fresh machine may have no package index yet: read it once, then try again
        for attempt in (install, ["apt-get", *wait_for_dpkg, "update", "-q"], install):
            try:
                code = subprocess.run(attempt, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, timeout=900).returncode
            except subprocess.TimeoutExpired:
                raise SlurmUnavailable(f"{' '.join(attempt)} did not finish within 900 s") from None
            if attempt is install and code == 0:
                break
    if missing_commands():
        tail = log.read_text(errors="replace")[-3000:]
        raise SlurmUnavailable(f"apt-get could not install {' '.join(PACKAGES)} "
                               f"({', '.join(missing_commands())} still missing); apt said:\n{tail}")


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child only calls into it
_PR_SET_PDEATHSIG = 1


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies without its teardown (a
    killed pytest would leave the daemons running otherwise). Runs after the user switch, which
    would clear it."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slurm_conf(root: Path, ctld_port: int, slurmd_port: int, epilog: Path) -> str:
    """``slurm.conf`` of the test cluster: one node, no accounting, requeue within seconds."""
    return "\n".join([
        "ClusterName=lightning-ft-test",
        f"SlurmctldHost={NODE}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # our own munged; a requeued job may start only after cred_expire (default 120 s)
        f"AuthInfo=socket={root}/munge/munge.socket,cred_expire=5",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",  # a requeued job starts within a second, not a minute
        "MpiDefault=none",
        "MailProg=/bin/true",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        # lightning_ft's codes: 81 stopped and saved, 82 unhealthy node, 143 stopped unsaved
        "JobRequeue=1",
        "RequeueExit=81,82,143",
        f"KillWait={KILL_WAIT}",
        "MinJobAge=900",  # finished jobs stay visible to scontrol (there is no accounting database)
        "ReturnToService=2",
        "EnforcePartLimits=ALL",
        # the node drains itself when lightning_ft's health probes fail after a job (docs/slurm.md)
        f"Epilog={epilog}",
        "SlurmdParameters=config_overrides",  # more CPUs than the machine has: several jobs at once
        f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs=16 State=UNKNOWN",
        f"PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def epilog_wrapper(root: Path, python: str) -> str:
    """The Epilog slurmd runs: the example epilog with this test session's Python and markers.

    The tests model several nodes on one host: a job's simulated nodes keep their markers in
    ``markers/<job id>/``; any marker there makes the (one, real) node unhealthy.
    """
    return "\n".join([
        "#!/bin/bash",
        f"export LIGHTNING_FT_PYTHON={python}",
        f'export FT_EPILOG_MARKERS="{root}/markers/$SLURM_JOB_ID/*"',
        "export FT_EPILOG_HEALTH_ARGS=--no-accelerator",
        f'exec {EPILOG} >>"{root}/log/epilog.log" 2>&1',
        "",
    ])


@dataclass
class SlurmCluster:
    """A running test cluster; ``env()`` is the environment a client (sbatch, scontrol) needs."""

    root: Path
    python: str = sys.executable
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LIGHTNING_FT_", "TORCHELASTIC_"))}
        env.update(SLURM_CONF=str(self.conf), **extra)
        return env

    def markers(self, job_id: str) -> Path:
        """Where the simulated nodes of ``job_id`` keep their health markers (the Epilog reads them)."""
        path = self.root / "markers" / job_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    # ------------------------------------------------------------------ life cycle

    @classmethod
    def start(cls, python: str = sys.executable) -> SlurmCluster:
        base = Path(tempfile.mkdtemp(prefix="lightning_ft-slurm-"))
        base.chmod(0o755)  # munged wants every directory above its socket searchable by all
        cluster = cls(base, python)
        try:
            ensure_installed(base / "apt.log")
            cluster._write_config()
            cluster._start_daemons()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _write_config(self) -> None:
        for sub in ("state", "spool", "run", "log", "markers"):
            (self.root / sub).mkdir()
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        for path in (munge, key):
            shutil.chown(path, "munge", "munge")
        epilog = self.root / "epilog.sh"
        epilog.write_text(epilog_wrapper(self.root, self.python))
        epilog.chmod(0o755)
        self.conf.write_text(slurm_conf(self.root, _free_port(), _free_port(), epilog))

    def _start_daemons(self) -> None:
        munge = self.root / "munge"
        self._daemon("munged", ["munged", "--foreground", f"--socket={munge}/munge.socket",
                                f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
                                f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"],
                     user="munge")
        if not wait_for(lambda: (munge / "munge.socket").exists(), 15):
            raise SlurmUnavailable(f"munged did not start:\n{self.log('munged')}")
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-N", NODE, "-f", str(self.conf)])
        if not wait_for(lambda: self.node_state().startswith("IDLE"), 60, interval=0.2):
            raise SlurmUnavailable(f"the node did not become idle (state {self.node_state()!r}):\n"
                                   f"{self.log('slurmctld')}\n{self.log('slurmd')}")

    def _daemon(self, name: str, argv: list[str], user: str | None = None) -> None:
        with open(self.root / "log" / f"{name}.out", "wb") as out:
            self.daemons[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, env=self.env(),
                                                  start_new_session=True, user=user, group=user,
                                                  preexec_fn=_terminate_with_parent)

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.out"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        """Cancel every job, stop the daemons by pid, kill whatever job process is left."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.scontrol_quiet(["scancel", "--full", "--signal=KILL", *self.job_ids()])
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # slurmstepd daemonizes: its processes and the job's are found by their SLURM_CONF
        for _ in range(3):
            leftovers = self.job_processes()
            if not leftovers:
                break
            kill_pids(leftovers)
            time.sleep(0.2)
        shutil.rmtree(self.root, ignore_errors=True)

    def job_processes(self) -> list[int]:
        """Processes whose environment names this cluster's slurm.conf (slurmstepd, batch scripts, tasks)."""
        pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
        return [pid for pid in pids
                if pid != os.getpid() and process_environ(pid).get("SLURM_CONF") == str(self.conf)]

    # ------------------------------------------------------------------ clients

    def run(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env(), timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def scontrol_quiet(self, argv: list[str]) -> None:
        try:
            self.run(argv, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def sbatch(self, script: Path, args: list[str], options: list[str], env: dict[str, str]) -> str:
        """Submit ``script args`` with sbatch ``options``; the job id."""
        result = subprocess.run(["sbatch", "--parsable", *options, str(script), *args], capture_output=True,
                                text=True, env=self.env(**env), timeout=30, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed ({result.returncode}): {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (empty once SLURM forgot the job)."""
        result = self.run(["scontrol", "show", "job", "-o", job_id])
        if result.returncode != 0:
            return {}
        return parse_record(result.stdout)

    def job_ids(self) -> list[str]:
        result = self.run(["squeue", "-h", "-o", "%i"])
        return result.stdout.split() if result.returncode == 0 else []

    def node(self) -> dict[str, str]:
        result = self.run(["scontrol", "show", "node", "-o", NODE])
        return parse_record(result.stdout) if result.returncode == 0 else {}

    def node_state(self) -> str:
        return self.node().get("State", "")

    def scancel(self, job_id: str, *options: str) -> None:
        result = self.run(["scancel", *options, job_id])
        if result.returncode != 0:
            raise RuntimeError(f"scancel {' '.join(options)} {job_id} failed: {result.stderr}")


def process_environ(pid: int) -> dict[str, str]:
    """The environment a process started with ({} once it is gone, or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def parse_record(text: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` (one-line scontrol output) as a dict; values may not contain spaces,
    except the last key's (``Reason=...`` texts are kept whole when they are last)."""
    record: dict[str, str] = {}
    key = None
    for token in text.strip().split(" "):
        name, sep, value = token.partition("=")
        if sep and name and name.replace("/", "").replace(":", "").isalnum():
            key = name
            record[key] = value
        elif key is not None:
            record[key] += " " + token
    return record

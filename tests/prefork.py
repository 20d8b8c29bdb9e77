"""Start the suite's Python processes from a fork server that has imported torch and Lightning.

Importing torch + Lightning costs ~5 CPU-s per process on this machine (Lightning pulls in
``torch._dynamo``); the suite starts ~300 such processes, which was most of its time. A fork
server pays for the import once (per xdist worker and start-up environment) and forks a child
per process: the child is an ordinary OS process in a session of its own -- real pid, real
signals, real sockets -- that runs the script from its first line, exactly as
``python script.py args`` would, with the test's environment, working directory and log file.

What a fork shares that a fresh interpreter would not have: the modules imported before the fork
(torch, numpy, Lightning, torchmetrics -- *not* lightning_ft, which each child imports itself) and
what they read from the environment when they were imported. So a server serves only requests
whose environment equals its own except for variables that are read at run time (``RUNTIME_ONLY``);
any other environment gets a server of its own. numpy's global random state is reseeded in the
child (Python's ``random`` reseeds itself after a fork); torch's default generator starts from the
same fixed seed in every fresh process anyway.

Processes the suite starts otherwise (torchrun, srun, shell wrappers, ``python -c``) and the
examples and the demo keep starting fresh interpreters, which keeps the real start-up path tested.

Protocol: the client connects to the server's Unix socket and sends one JSON line (argv, env,
cwd, log path); the server forks, answers with the child's pid and a result path, and writes the
child's exit status (``Popen.returncode`` convention: ``-N`` for signal N) to that path once it
has reaped the child.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

#: variables only read after start-up (by lightning_ft, the test scripts, torch.distributed's
#: rendezvous), so a server imported under other values serves them; never Lightning's rank
#: variables (RANK, LOCAL_RANK, SLURM_PROCID), which it reads on import
RUNTIME_ONLY_PREFIXES = ("LIGHTNING_FT_", "LU_", "FT_", "AWS_")
#: PYTHONPATH among them: the child puts the request's entries on its ``sys.path`` (see _become)
RUNTIME_ONLY = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "PYTEST_CURRENT_TEST", "PYTHONPATH",
                "NODE_NAME", "TEST_OUT"}
PRELOADED = ("numpy", "torch", "torch.distributed", "lightning.pytorch", "torchmetrics")
#: servers per worker (one per start-up environment); more environments start fresh interpreters.
#: A server used once costs what a fresh interpreter does, so the bound is only for memory
MAX_SERVERS = 8
#: how long a request waits for its server to finish importing (a loaded machine: ~10 s)
READY_WAIT = 60.0
DISABLE_ENV = "LIGHTNING_FT_TESTS_NO_PREFORK"
#: the suite's timeline (tests/conftest.py): the server adds a line per child it reaped
TIMELINE_ENV = "LIGHTNING_FT_TEST_TIMELINE"


def startup_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of an environment a preloaded import may have read."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if not k.startswith(RUNTIME_ONLY_PREFIXES) and k not in RUNTIME_ONLY))


# ------------------------------------------------------------------------------------ client


class ForkedPopen:
    """The part of ``subprocess.Popen`` the suite uses, for a process the fork server started."""

    def __init__(self, args: list[str], pid: int, result: Path) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._result = result

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._result.read_text())
            except (FileNotFoundError, ValueError):
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self, root: Path, env: dict[str, str]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.socket_path = root / "server.sock"
        self.results = root / "results"
        self.results.mkdir(exist_ok=True)
        with open(root / "server.log", "wb") as log:
            self.popen = subprocess.Popen(
                [sys.executable, __file__, str(self.socket_path), str(self.results), str(os.getpid()),
                 os.environ.get(TIMELINE_ENV, "")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def ready(self) -> bool:
        return self.popen.poll() is None and self.socket_path.exists()

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server serves within ``timeout`` seconds (False at once if it died)."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def start(self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path) -> ForkedPopen:
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": str(log_path)}).encode() + b"\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(str(self.socket_path))
            conn.sendall(request)
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    raise OSError("the fork server closed the connection without an answer")
                answer += chunk
        reply = json.loads(answer)
        return ForkedPopen(argv, reply["pid"], Path(reply["result"]))

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class Launcher:
    """Per test process: one fork server per start-up environment, started on first need.

    A request that finds its server still importing waits for it (up to :data:`READY_WAIT`)
    instead of starting a fresh interpreter: a fresh one imports as long as the server does, so
    waiting costs no time, and the suite's tests start several processes at once -- each fresh
    one would be another ~4 CPU-s of imports on a machine that is short of CPU (measured: a third
    of the suite's fresh interpreters were started while their server imported). A server that
    does not come up in time, or more start-up environments than :data:`MAX_SERVERS`, start
    processes the ordinary way."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.servers: dict[tuple, _Server] = {}
        self.lock = threading.Lock()

    @staticmethod
    def eligible(argv: list[str]) -> bool:
        return (len(argv) >= 2 and argv[0] == sys.executable
                and (argv[1] == "-m" and len(argv) >= 3 or argv[1].endswith(".py") and not argv[1].startswith("-")))

    def start(self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path) -> ForkedPopen | None:
        if not self.eligible(argv) or os.environ.get(DISABLE_ENV):
            return None
        server = self.server_for(env)
        if server is None or not server.wait_ready(READY_WAIT):
            return None
        try:
            return server.start(argv, env, cwd, log_path)
        except (OSError, ValueError) as exc:  # the server went away: start this one the ordinary way
            print(f"prefork: {server.socket_path}: {exc}; starting {argv[1:3]} as a fresh interpreter",
                  file=sys.stderr)
            return None

    def server_for(self, env: dict[str, str]) -> _Server | None:
        """The server of ``env``'s start-up environment, started now if it is new (None: too many)."""
        key = startup_key(env)
        with self.lock:
            server = self.servers.get(key)
            if server is None and len(self.servers) < MAX_SERVERS:
                server = self.servers[key] = _Server(self.root / f"server-{len(self.servers)}", env)
            return server

    def stop(self) -> None:
        with self.lock:
            for server in self.servers.values():
                server.stop()
            self.servers.clear()


# ------------------------------------------------------------------------------------ server


def _serve(socket_path: str, results: str, parent: int) -> dict | None:
    """Accept requests until the parent (the test process) is gone; in a forked child, return
    that child's request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(16)
    os.rename(socket_path + ".tmp", socket_path)  # the client takes its existence as "ready"
    children: dict[int, tuple[str, dict]] = {}
    serial = 0
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.02)
        if readable:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(30)
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if not data.endswith(b"\n"):
                    continue
                request = json.loads(data)
                serial += 1
                result = os.path.join(results, f"{serial}.rc")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    listener.close()
                    return request
                children[pid] = (result, request)
                conn.sendall(json.dumps({"pid": pid, "result": result}).encode() + b"\n")
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            entry = children.pop(pid, None)
            if entry is not None:
                result, request = entry
                with open(result + ".tmp", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.rename(result + ".tmp", result)
                _account(request, usage)
    return None


def _account(request: dict, usage) -> None:
    """Where the suite's timeline is kept (conftest.py's TIMELINE_ENV): one line per reaped child
    with the CPU it used and the test that started it -- where the suite's CPU goes."""
    path = sys.argv[4]
    if path:
        line = json.dumps({"process": request["argv"][1:4], "test": request["env"].get("PYTEST_CURRENT_TEST", "?"),
                           "cpu": round(usage.ru_utime + usage.ru_stime, 3)})
        with open(path, "a") as timeline:
            timeline.write(line + "\n")


def _become(request: dict) -> None:
    """In the forked child: set up what ``Popen(argv, env, cwd, start_new_session=True)`` with the
    log as stdout and stderr would have, then run the script (or module) as ``__main__``."""
    import runpy

    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if "numpy" in sys.modules:  # a fresh interpreter seeds it from the OS: siblings must differ
        sys.modules["numpy"].random.seed()
    # the request's PYTHONPATH (a runtime-only variable here), as a fresh interpreter would have it:
    # after the script's directory, before the site-packages the preloaded modules came from
    extra = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[1:1] = [entry for entry in extra if entry not in sys.path]
    argv = request["argv"][1:]
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    import gc
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    # what is imported now lives as long as any child: keep the collector from touching (and so
    # copying) those pages in every child (the gc docs' advice for pre-forking servers)
    gc.collect()
    gc.freeze()
    _request = _serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    if _request is not None:
        del importlib
        _become(_request)

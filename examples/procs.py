"""Processes the demo (and the test suite) starts: each in a session of its own, its output in a
log file, and every one of them killed by pid at the end -- also on Ctrl-C or a timeout."""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def write_secret(directory: Path) -> str:
    """A new job secret in ``directory``, in a file only this user can read (created 0600, as a
    launcher makes one: docs/trust.md); its path, for ``LIGHTNING_FT_SECRET_FILE``."""
    path = Path(directory) / "job.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    return str(path)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def signal_group(self, sig: int) -> None:
        """Signal the process and everything it started (it leads its own session)."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.popen.pid, sig)
        except ProcessLookupError:
            pass


class ProcessSet:
    """Starts processes in their own sessions (``start``) and kills each whole session (``kill_all``)."""

    def __init__(self, log_dir: Path, cwd: str | Path | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.cwd = cwd
        #: name -> process, in start order
        self.procs: dict[str, Proc] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: str | Path | None = None) -> Proc:
        if name in self.procs:  # a second one would be lost to kill_all
            raise ValueError(f"a process named {name!r} was started already")
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd or self.cwd, start_new_session=True)
        proc = Proc(name, popen, log_path)
        self.procs[name] = proc
        return proc

    def kill_all(self) -> None:
        for proc in self.procs.values():
            proc.signal_group(signal.SIGKILL)
            proc.signal(signal.SIGKILL)
        # one bound for all of them (was 10 s each): the caller's exit must not wait longer
        # than that however many processes a loaded machine is slow to reap
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


#: ports below the kernel's ephemeral range (net.ipv4.ip_local_port_range starts at 32768 on common
#: Linux setups): a store's port, freed when its process dies, is then never handed to another
#: process's outgoing connection or listener (gloo's), which would accept the participants'
#: connects and never answer -- a fail-over or a truthful exit would wait out a connect timeout
STORE_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port of :data:`STORE_PORTS` that nothing listens on now (chosen at random among them, with
    the operating system's randomness: a test may have seeded Python's)."""
    chooser = random.SystemRandom()
    for _ in range(200):
        port = chooser.choice(STORE_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {STORE_PORTS.start}..{STORE_PORTS.stop - 1}")

"""Quiet by the library, not by the test environment (issue 45): a process with a user's own
environment -- no ``TORCH_CPP_LOG_LEVEL`` -- that imports lightning_ft prints none of torch's
C++ warnings for the store connections the package opens and breaks on purpose; a user who sets
the variable gets what it says."""

from __future__ import annotations

import os
import subprocess
import sys

from proc_utils import REPO_ROOT

# a store client that retries a port where nothing listens: torch's C++ code warns on each retry
# ("[W... TCPStore.cpp] ... retrying"); with lightning_ft imported first the warnings are gone
SCRIPT = """
import datetime, sys
import lightning_ft.deadlines
import torch.distributed as dist
try:
    dist.TCPStore("127.0.0.1", 1, is_master=False, timeout=datetime.timedelta(seconds=1))
except Exception as exc:
    print("raised", type(exc).__name__)
"""


def run(**env: str) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    environment.update(env, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, capture_output=True, text=True,
                          timeout=120)
    return done.stdout + done.stderr


def test_torchs_cpp_warnings_are_quiet_in_a_users_own_environment():
    output = run()
    assert "raised DistNetworkError" in output, output
    assert not [line for line in output.splitlines() if line.startswith("[W")], output


def test_a_level_the_user_chose_is_left_as_it_is():
    output = run(TORCH_CPP_LOG_LEVEL="WARNING")
    assert [line for line in output.splitlines() if line.startswith("[W")], output


# a store that answers the package's ping and dies as the client connects: every later
# connection is closed at once. torch's client retries the handshake until its timeout, then
# logs the failure at ERROR with the exception's C++ stack before raising it (seen in a loaded
# suite run: 14 "frame #" lines from a participant whose store was SIGKILLed just then)
DYING_STORE = """
import socket, threading
import lightning_ft._torch as ft_torch
from lightning_ft.settings import Timeouts
from lightning_ft.store.tcp import Endpoint, connect_store

server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(16)

def serve():
    first = True
    while True:
        conn, _ = server.accept()
        with conn:
            if first:  # the ping: VALIDATE + PING(nonce), answered with the nonce as a store does
                first = False
                asked = b""
                while len(asked) < 10:
                    asked += conn.recv(64)
                conn.sendall(asked[-4:])

threading.Thread(target=serve, daemon=True).start()
try:
    connect_store(Endpoint("127.0.0.1", server.getsockname()[1]), False, Timeouts(connect_timeout=2.0))
except Exception as exc:
    print("raised", type(exc).__name__, str(exc).splitlines()[0])
"""


def test_a_store_that_dies_as_a_client_connects_leaves_no_cpp_stack_in_the_log():
    environment = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    environment["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run([sys.executable, "-c", DYING_STORE], env=environment, capture_output=True, text=True,
                          timeout=120)
    output = done.stdout + done.stderr
    assert "raised RendezvousConnectionError cannot reach the rendezvous store" in output, output
    assert "frame #" not in output and not [line for line in output.splitlines() if line.startswith("[E")], output

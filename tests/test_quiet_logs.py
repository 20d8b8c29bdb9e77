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

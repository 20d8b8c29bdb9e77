"""``Trainer(devices=N)`` under ``ddp_ft``: the first process of a node starts the other N-1.

As Lightning's own ``ddp`` launcher does, each is the user's script run again (the same command
line, found by Lightning's helper); unlike it, each is a participant of its own in the job's
rendezvous -- its failure is recovered like any participant's -- and nothing here kills the
others when one of them ends: the rendezvous decides. They share the node's failure domain (the
host name, or LIGHTNING_FT_DOMAIN_ID), so snapshot copies go to other nodes. The first process
waits for them before it leaves (a scheduler ends a task's leftovers when its first process
exits): up to 2 min at interpreter exit, a few seconds on an exit that must be prompt. They end
with it (``die_with_parent``: the kernel kills them when the thread that started them ends, so
start ``fit()`` from the thread that lives as long as the process, as scripts do).
"""

from __future__ import annotations

import logging
import os
import subprocess

from lightning_ft._clock import monotonic
from lightning_ft._lightning.launcher import script_command
from lightning_ft._logging import StrategyLog
from lightning_ft.process import before_leaving
from lightning_ft.settings.environment import ENV_LOCAL_PARENT, ENV_LOCAL_PROCESS, child_environment

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})

_started: list[subprocess.Popen] = []


def start_local_processes(count: int) -> list[subprocess.Popen]:
    """Start this node's processes 1..count-1 (once per process; later calls return them)."""
    if _started or count <= 1:
        return _started
    command = script_command()
    for index in range(1, count):
        # the first process alone hosts the store when it was told to (one host per endpoint)
        env = child_environment(**{ENV_LOCAL_PROCESS: str(index), ENV_LOCAL_PARENT: str(os.getpid()),
                                   "LIGHTNING_FT_IS_STORE_HOST": "0"})
        _started.append(subprocess.Popen(command, env=env))
    ft_log.info("devices=%d: started this node's processes %s (pids %s), each a participant", count,
             ", ".join(str(i) for i in range(1, count)), ", ".join(str(p.pid) for p in _started))
    before_leaving(_wait_for_local_processes)
    return _started


def _wait_for_local_processes(seconds: float) -> None:
    deadline = monotonic() + seconds
    for process in _started:
        try:
            process.wait(max(0.0, deadline - monotonic()))
        except subprocess.TimeoutExpired:
            ft_log.warning("this node's process %d is still running %.0fs after this one finished; it ends "
                        "with this one", process.pid, seconds)

"""A process whose threads are inside store calls when it ends exits with its own code (issue 24,
finding 8: a hot spare leaving fit() now and then died with SIGABRT instead of exiting 0).

On Python < 3.14 a daemon thread that comes back from a store call (C++) while the interpreter
finalizes aborts the process. ``tests/scripts/store_calls_at_exit.py`` makes that happen: one
thread sets a key without pause (never stopped, like the heartbeat an excluded participant left
running), another waits for a key that this test sets only after the main thread ended, and its
finalization lasts until that key exists. Before store calls were closed at interpreter exit it
aborted in nearly every run.
"""

from __future__ import annotations

import pytest

from proc_utils import REPO_ROOT, child_env, wait_for

pytestmark = [pytest.mark.multiprocess]

SCRIPT = str(REPO_ROOT / "tests" / "scripts" / "store_calls_at_exit.py")


@pytest.mark.timeout(150)
def test_threads_inside_store_calls_at_exit_neither_abort_the_process_nor_change_its_exit_code(processes,
                                                                                                tcp_store):
    proc = processes.python("exiting", [SCRIPT, "--port", str(tcp_store.port), "--key", "answer"], env=child_env())
    assert wait_for(lambda: "main done" in proc.log() or proc.popen.poll() is not None, 90), proc.log()
    tcp_store.set("answer", "1")  # the waiting thread's call returns now: after the main thread ended
    assert wait_for(lambda: proc.popen.poll() is not None, 45), proc.log()
    log = proc.log()
    assert proc.popen.returncode == 0, log
    assert "finalized" in log, log  # the interpreter did finalize, with the answer on its way
    assert "terminate called" not in log, log

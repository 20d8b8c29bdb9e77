from __future__ import annotations

import datetime
import os

import pytest

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from proc_utils import ProcessSet, free_port  # noqa: E402


@pytest.fixture
def processes(tmp_path):
    """Real processes for a test; all are killed (whole sessions, by pid) at teardown."""
    procs = ProcessSet(log_dir=tmp_path)
    try:
        yield procs
    finally:
        procs.kill_all()


@pytest.fixture
def tcp_store():
    """A real TCPStore server on 127.0.0.1 with a free port."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    yield store


@pytest.fixture
def port():
    return free_port()

"""Who a participant is: identity, failure domain and the scheduler's node index."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_ft.schema.run import SEP
from lightning_ft.settings.environment import resolve_domain_id, scheduler_node_index


@dataclass(frozen=True)
class ParticipantInfo:
    """Identity of one rendezvous participant (a node agent or a training process)."""

    addr: str
    pid: int
    local_id: int = 0
    #: the scheduler's node index (SLURM_NODEID, JobSet index, ...); -1 when unknown
    infra_rank: int = -1
    #: failure/network domain; active nodes of one segment share it
    domain_id: str = "none"

    @property
    def participant_id(self) -> str:
        return f"{self.addr}:{self.pid}:{self.local_id}"

    def __post_init__(self) -> None:
        for name in ("addr", "domain_id"):
            value = getattr(self, name)
            if not value or SEP in value:
                raise ValueError(f"participant {name} must be a non-empty string without control "
                                 f"characters, got {value!r}")


def local_participant(local_id: int = 0, domain_id: str | None = None, infra_rank: int | None = None,
                      addr: str | None = None, env: Mapping[str, str] | None = None) -> ParticipantInfo:
    """Describe this process as a participant; the domain and the node index not given are
    resolved as every entry point resolves them (:mod:`lightning_ft.settings.environment`)."""
    return ParticipantInfo(
        addr=addr or socket.gethostname(),
        pid=os.getpid(),
        local_id=local_id,
        infra_rank=scheduler_node_index(env) if infra_rank is None else infra_rank,
        domain_id=resolve_domain_id(domain_id, env),
    )


_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """When this process started (wall clock): from ``/proc`` on Linux, else when this module loaded.

    A run's incarnation is decided by it: a process started before the run closed belongs to
    that run (a late starter), one started after it belongs to a new launch of the run id.
    """
    try:
        with open("/proc/self/stat") as f:
            ticks_after_boot = int(f.read().rsplit(")", 1)[1].split()[19])
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        # the start is counted in ticks of the boot-time clock; measured against that clock now,
        # not against /proc/stat's btime, which is whole seconds (up to 1 s early: a process
        # started just after the previous launch closed was taken for one of its late starters).
        # The tick count is rounded down: the end of its tick, never before the true start.
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - (ticks_after_boot + 1) * tick
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT

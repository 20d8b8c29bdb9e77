"""Who a participant is, and how its slot is written to the store."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping

_FIELD_SEP = "\x1f"  # unit separator: never appears in host names or domain ids
_SLOT_VERSION = "1"


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
            if not value or _FIELD_SEP in value:
                raise ValueError(f"participant {name} must be a non-empty string without control "
                                 f"characters, got {value!r}")


@dataclass(frozen=True)
class Slot:
    """What a slot key holds: a participant, the round it joined, and its status."""

    cycle_id: int
    info: ParticipantInfo
    withdrawn: bool = False


def encode_slot(slot: Slot) -> bytes:
    # A flat separator format, not JSON: the coordinator decodes every slot of a round
    # on each re-read, and for 10,000 slots JSON decoding costs more than the multi_get.
    info = slot.info
    fields = (_SLOT_VERSION, str(slot.cycle_id), "1" if slot.withdrawn else "0", str(info.infra_rank),
              info.domain_id, info.addr, str(info.pid), str(info.local_id))
    return _FIELD_SEP.join(fields).encode()


def decode_slot(raw: bytes) -> Slot | None:
    """Decode a slot value; ``None`` for anything that is not a well-formed slot."""
    try:
        version, cycle, withdrawn, infra, domain, addr, pid, local_id = raw.decode().split(_FIELD_SEP)
        if version != _SLOT_VERSION:
            return None
        info = ParticipantInfo(addr=addr, pid=int(pid), local_id=int(local_id),
                               infra_rank=int(infra), domain_id=domain)
        return Slot(cycle_id=int(cycle), info=info, withdrawn=withdrawn == "1")
    except (ValueError, UnicodeDecodeError):
        return None


# Environment variables that carry the scheduler's node index, first match wins.
_INFRA_RANK_VARIABLES = (
    "LIGHTNING_FT_INFRA_RANK",  # explicit override
    "SLURM_NODEID",
    "SLURM_PROCID",
    "JOB_COMPLETION_INDEX",  # Kubernetes indexed Job / JobSet
    "GROUP_RANK",
)


def detect_infra_rank(env: Mapping[str, str] | None = None) -> int:
    """The scheduler's index of this node, or -1 when no known variable says it."""
    env = os.environ if env is None else env
    for name in _INFRA_RANK_VARIABLES:
        value = env.get(name)
        if value is None or value == "":
            continue
        try:
            rank = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer node index") from None
        if rank < 0:
            raise ValueError(f"{name}={value!r} must not be negative")
        return rank
    return -1


def local_participant(local_id: int = 0, domain_id: str | None = None, infra_rank: int | None = None,
                      addr: str | None = None, env: Mapping[str, str] | None = None) -> ParticipantInfo:
    """Describe this process as a participant, filling unknown fields from the environment."""
    env = os.environ if env is None else env
    return ParticipantInfo(
        addr=addr or socket.gethostname(),
        pid=os.getpid(),
        local_id=local_id,
        infra_rank=detect_infra_rank(env) if infra_rank is None else infra_rank,
        domain_id=domain_id or env.get("LIGHTNING_FT_DOMAIN_ID") or "none",
    )

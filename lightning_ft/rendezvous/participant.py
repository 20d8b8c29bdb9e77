"""Who a participant is, and how its slot is written to the store."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, NamedTuple

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


class Slot(NamedTuple):
    """What a slot key holds: the round it was written in, the participant, its status.

    A NamedTuple, not a dataclass: the coordinator decodes every slot of a round on each
    re-read, and for 10,000 slots object construction cost more than the ``multi_get``.
    """

    cycle_id: int
    withdrawn: bool
    infra_rank: int
    domain_id: str
    participant_id: str


def encode_slot(cycle_id: int, info: ParticipantInfo, withdrawn: bool = False) -> bytes:
    # flat separator format; round first, so stale slots can be told apart before decoding
    return _FIELD_SEP.join((str(cycle_id), _SLOT_VERSION, "1" if withdrawn else "0", str(info.infra_rank),
                            info.domain_id, info.participant_id)).encode()


def decode_slot(raw: bytes) -> Slot | None:
    """Decode a slot value; ``None`` for anything that is not a well-formed slot."""
    try:
        cycle, version, withdrawn, infra, domain, participant_id = raw.decode().split(_FIELD_SEP)
        if version != _SLOT_VERSION:
            return None
        return Slot(int(cycle), withdrawn == "1", int(infra), domain, participant_id)
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

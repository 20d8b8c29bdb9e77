"""Run scope: the rendezvous keys of one run, under ``lightning_ft/<run_id>/i<incarnation>/``.

A run id can be used again -- a requeued job keeps its scheduler job id, a long-lived store
outlives jobs -- so every launch of a run is an *incarnation* with keys of its own; nothing
of an earlier incarnation ("closed for good" above all) is seen by a later one (see
:func:`~lightning_ft.rendezvous.decisions.choose_incarnation`). Round-scoped keys carry the
round number (``r{N}/...``). Slot keys are shared by all rounds of an incarnation and never
cleared; the round inside each slot value tells readers which round wrote it. Every value a
reader decodes has its encoder here, next to it; values are sealed with the job secret by
:class:`~lightning_ft.schema.signing.SealedStore`.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple, Protocol

# torch's elastic agent writes this key under the store a rendezvous returns once every
# agent of the group passed its exit barrier (torch's _TERMINAL_STATE_SYNC_ID +
# _LAST_MEMBER_CHECKIN). Spelled out rather than imported: importing torch's agent from here
# loads torch's rendezvous registry, which imports lightning_ft.rendezvous, which needs this
# module -- a cycle that silently dropped the "lightning_ft" torchrun backend. The torchrun
# handler (the only code that relies on torch writing this key) checks the names against
# torch at import and fails loudly if a torch version renamed them.
EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"
EXIT_BARRIER_KEY = EXIT_BARRIER_PREFIX + "/last_member"

#: the unit separator between the fields of a value: never in host names, ids or domains
SEP = "\x1f"


def incarnation_key(run_id: str) -> str:
    """The counter of a run's incarnations (the newest one is current)."""
    return f"lightning_ft/{run_id}/incarnation"


class RunKeys:
    """Key layout of one incarnation of a run: ``lightning_ft/<run_id>/i<incarnation>/``."""

    def __init__(self, run_id: str, incarnation: int = 0) -> None:
        self.run_id = run_id
        self.incarnation = incarnation
        self.prefix = f"lightning_ft/{run_id}/i{incarnation}"
        p = self.prefix
        #: the current round (an integer counter; ``compare_set`` moves it on)
        self.round = f"{p}/round"
        #: the run is over (a CloseReason); stored under ``SealedStore.unlisted(...)`` of this
        #: name, so that a client without the secret cannot find it to overwrite it
        self.closed_for_good = f"{p}/closed_for_good"
        self.lost_count = f"{p}/lost_count"
        self.unhealthy_count = f"{p}/unhealthy_count"
        self.last_actives = f"{p}/last_actives"
        self.shutdown_acks = f"{p}/shutdown_acks"
        #: the log versions of the run's loggers, decided once by rank 0 of the first round
        self.log_versions = f"{p}/log_versions"

    def round_key(self, round_id: int, name: str) -> str:
        return f"{self.prefix}/r{round_id}/{name}"

    def arrived(self, round_id: int) -> str:
        return self.round_key(round_id, "arrived")

    def written(self, round_id: int) -> str:
        return self.round_key(round_id, "written")

    def withdrawn(self, round_id: int) -> str:
        return self.round_key(round_id, "withdrawn")

    def ready(self, round_id: int) -> str:
        return self.round_key(round_id, "ready")

    def coordinator(self, round_id: int) -> str:
        return self.round_key(round_id, "coordinator")

    def coordinator_beat(self, round_id: int) -> str:
        return self.round_key(round_id, "coordinator_beat")

    def round_store_prefix(self, round_id: int) -> str:
        """Prefix of the store handed to the training job of this round (see :mod:`.round`)."""
        return self.round_key(round_id, "job")

    def exit_barrier(self, round_id: int) -> str:
        return f"{self.round_store_prefix(round_id)}/{EXIT_BARRIER_KEY}"

    def slot(self, index: int) -> str:
        return f"{self.prefix}/slot/{index}"

    def decided_rank(self, round_id: int, decision: str, index: int) -> str:
        """A coordinator's answer for one slot, under its own decision: the ``ready`` marker names
        the decision in force, so answers of a coordinator that lost the race (or died half-way
        and was taken over) can never mix with the effective ones."""
        return self.round_key(round_id, f"decision/{decision}/slot/{index}")

    def heartbeat(self, participant_id: str) -> str:
        return f"{self.prefix}/heartbeat/{participant_id}"

    def lost_marker(self, participant_id: str) -> str:
        return f"{self.prefix}/lost/{participant_id}"

    def ack(self, participant_id: str) -> str:
        return f"{self.prefix}/ack/{participant_id}"

    def slot_keys(self, count: int) -> list[str]:
        return list(_slot_keys(self.prefix, count))


@lru_cache(maxsize=8)
def _slot_keys(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}/slot/{i}" for i in range(count))


# ---------------------------------------------------------------------------- slots

_SLOT_VERSION = "1"


class SlotWriter(Protocol):
    @property
    def participant_id(self) -> str: ...
    @property
    def infra_rank(self) -> int: ...
    @property
    def domain_id(self) -> str: ...


class Slot(NamedTuple):
    """What a slot key holds: the round it was written in, the participant, its status.

    A NamedTuple, not a dataclass: the coordinator decodes every slot of a round on each
    re-read, and for 10,000 slots object construction cost more than the ``multi_get``.
    """

    round: int
    withdrawn: bool
    infra_rank: int
    domain_id: str
    participant_id: str


def encode_slot(round_id: int, info: SlotWriter, withdrawn: bool = False) -> bytes:
    # flat separator format; round first, so stale slots can be told apart before decoding
    return SEP.join((str(round_id), _SLOT_VERSION, "1" if withdrawn else "0", str(info.infra_rank),
                     info.domain_id, info.participant_id)).encode()


def decode_slot(raw: bytes) -> Slot | None:
    """Decode a slot value; ``None`` for anything that is not a well-formed slot."""
    try:
        round_text, version, withdrawn, infra, domain, participant_id = raw.decode().split(SEP)
        if version != _SLOT_VERSION:
            return None
        return Slot(int(round_text), withdrawn == "1", int(infra), domain, participant_id)
    except (ValueError, UnicodeDecodeError):
        return None


class SlotRank(NamedTuple):
    """The coordinator's answer for one slot: rank ``-1`` is standby."""

    round: int
    rank: int
    world_size: int


def encode_slot_rank(round_id: int, rank: int, world_size: int) -> str:
    return f"{round_id},{rank},{world_size}"


def decode_slot_rank(raw: bytes) -> SlotRank | None:
    try:
        round_text, rank, world = raw.decode().split(",")
        return SlotRank(int(round_text), int(rank), int(world))
    except (ValueError, UnicodeDecodeError):
        return None


def encode_last_actives(round_id: int, participant_ids: list[str] | tuple[str, ...]) -> str:
    return SEP.join([str(round_id), *participant_ids])


def decode_last_actives(raw: bytes) -> tuple[int, tuple[str, ...]] | None:
    """(round, participant ids in rank order) of the newest completed round, or None."""
    try:
        round_text, *ids = raw.decode().split(SEP)
        return int(round_text), tuple(ids)
    except (ValueError, UnicodeDecodeError):
        return None


class Ready(NamedTuple):
    """The ``ready`` marker of a round: which coordinator decision is in force (the rest is for humans)."""

    world_size: int
    standby: int
    seconds: float
    decision: str


def encode_coordinator(participant_id: str, replaced: tuple[str, ...] = ()) -> str:
    """Who coordinates a round, followed by every coordinator it took over from, directly or not.

    A takeover from a live but slow coordinator must keep suspecting the silent one that one
    had replaced: the chain travels with the key, not in one process's memory.
    """
    return SEP.join((participant_id, *replaced))


def decode_coordinator(raw: str) -> tuple[str, tuple[str, ...]]:
    """``(holder, replaced)`` of a coordinator value ("" -> nobody)."""
    holder, *replaced = raw.split(SEP) if raw else [""]
    return holder, tuple(replaced)


def encode_ready(world_size: int, standby: int, seconds: float, decision: str) -> str:
    return f"{world_size},{standby},{seconds:.4f},{decision}"


def decode_ready(raw: bytes) -> Ready | None:
    try:
        world, standby, seconds, decision = raw.decode().split(",", 3)
        return Ready(int(world), int(standby), float(seconds), decision)
    except (ValueError, UnicodeDecodeError):
        return None


def encode_log_versions(versions: list[int | str | None]) -> str:
    return json.dumps(list(versions))


def decode_log_versions(raw: bytes) -> list[int | str | None]:
    try:
        versions = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return []
    return [v for v in versions if v is None or isinstance(v, (int, str))] if isinstance(versions, list) else []


# ---------------------------------------------------------------------------- closing

class CloseKind(enum.Enum):
    """Why a run's rendezvous was closed for good."""

    #: the actives completed ``fit()`` (or torchrun's agents passed the exit barrier)
    FINISHED = "finished"
    #: a deliberate stop: the SIGTERM path, a KeyboardInterrupt, SystemExit
    STOPPED = "stopped"
    #: a participant failed with its own error, or gave up (NO_RESTART)
    FAILED = "failed"
    #: fewer than ``min_nodes`` participants can still take part
    TOO_FEW_NODES = "too_few_nodes"
    #: closed from outside (torch's ``set_closed()``), or a value not written by this schema
    CLOSED = "closed"

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {CloseKind.FINISHED: "job finished", CloseKind.STOPPED: "job stopped", CloseKind.FAILED: "job failed",
           CloseKind.TOO_FEW_NODES: "too few nodes", CloseKind.CLOSED: "closed"}


@dataclass(frozen=True)
class CloseReason:
    """The value of ``closed_for_good``: a kind to act on, a text for people, and when (wall clock)."""

    kind: CloseKind
    text: str
    closed_at: float = field(default_factory=time.time)

    def __str__(self) -> str:
        return f"{self.kind.label}: {self.text}"

    def encode(self) -> str:
        return SEP.join((self.kind.value, repr(float(self.closed_at)), self.text))

    @classmethod
    def decode(cls, raw: bytes) -> CloseReason | None:
        """None for a value that is not a close reason of this format."""
        try:
            kind_text, when, text = raw.decode().split(SEP, 2)
            return cls(CloseKind(kind_text), text, float(when))
        except (ValueError, UnicodeDecodeError):
            return None

"""Run scope: the rendezvous keys of one run, under ``lightning_ft/<run_id>/i<incarnation>/``.

A run id can be used again -- a requeued job keeps its scheduler job id, a long-lived store
outlives jobs -- so every launch of a run is an *incarnation* with keys of its own; nothing
of an earlier incarnation ("closed for good" above all) is seen by a later one (see
:func:`~lightning_ft.rendezvous.decisions.choose_incarnation`). Round-scoped keys carry the
round number (``r{N}/...``). Every value a reader decodes has its encoder here, next to it;
values and log records are sealed with the job secret by
:class:`~lightning_ft.schema.signing.SealedStore`.

*Counters are hints, sealed records are truth.* ``add`` cannot be sealed, so no counter decides
anything: the round, the incarnation, who arrived or withdrew, who is lost for good, heartbeats,
the coordinator's lease and the acknowledgements are sealed values or sealed records in
append-only logs. The one unsealed hint left (``appended``) tells a reader *when* to re-read a
log; forging it costs a re-read, nothing else. Nothing of ours calls ``add`` at all: on a value
a store client garbled, the server would drop the caller's connection.
"""

from __future__ import annotations

import enum
import json
import secrets
import time
from dataclasses import dataclass, field
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


#: this launch's id (a sealed random hex string, see :func:`new_launch_id`): written by whoever
#: hosts the store when it starts (or, if nobody did, by the first participant that finds none)
#: and read by every participant when it joins; store fail-over values, presence answers and
#: evictions are bound to it, so that a value of an earlier launch under the same secret (a
#: resubmission reusing the run id and the secret file, on a fresh store) does not verify
LAUNCH_KEY = "lightning_ft_launch/id"
_HEX = frozenset(b"0123456789abcdef")


def new_launch_id() -> str:
    """A fresh launch id: 128 random bits, as 32 lowercase hex digits."""
    return secrets.token_hex(16)


def is_launch_id(raw: bytes) -> bool:
    """Whether ``raw`` is a launch id as :func:`new_launch_id` makes them."""
    return len(raw) == 32 and all(byte in _HEX for byte in raw)


def incarnation_key(run_id: str) -> str:
    """The run's newest incarnation (a sealed number, see :func:`encode_number`)."""
    return f"lightning_ft/{run_id}/incarnation"


def encode_number(value: int) -> str:
    """A round or incarnation number as stored (sealed, so ``add`` can neither read nor bump it)."""
    return str(int(value))


def decode_number(raw: bytes | None) -> int | None:
    try:
        value = int(raw.decode()) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if value is not None and value >= 0 else None


class RunKeys:
    """Key layout of one incarnation of a run: ``lightning_ft/<run_id>/i<incarnation>/``."""

    def __init__(self, run_id: str, incarnation: int = 0) -> None:
        self.run_id = run_id
        self.incarnation = incarnation
        self.prefix = f"lightning_ft/{run_id}/i{incarnation}"
        p = self.prefix
        #: the current round (a sealed number; ``compare_set`` on its bytes moves it on)
        self.round = f"{p}/round"
        #: the run is over (a CloseReason); stored under ``SealedStore.unlisted(...)`` of this
        #: name, so that a client without the secret cannot compute it
        self.closed_for_good = f"{p}/closed_for_good"
        #: log of :class:`LostRecord`: participants lost for good (dead, unhealthy, withdrawn)
        self.lost = f"{p}/lost"
        self.last_actives = f"{p}/last_actives"
        #: the log versions of the run's loggers, decided once by rank 0 of the first round
        self.log_versions = f"{p}/log_versions"
        #: counters behind the ft/* metrics in the Trainer's loggers (runtime/run_metrics.py)
        self.run_metrics = f"{p}/run_metrics"
        #: what ckpt_path="best"/"last" named at the end of the newest fit() (its rank 0 writes it)
        self.fit_checkpoint_paths = f"{p}/fit_checkpoint_paths"

    def round_key(self, round_id: int, name: str) -> str:
        return f"{self.prefix}/r{round_id}/{name}"

    def arrivals(self, round_id: int) -> str:
        """Log of :class:`ArrivalRecord`: who arrived in (and withdrew from) the round, in order."""
        return self.round_key(round_id, "arrivals")

    def appended(self, round_id: int) -> str:
        """The last appender's mark, set after each append to :meth:`arrivals`: a hint to re-read it, no more."""
        return self.round_key(round_id, "appended")

    def ready(self, round_id: int) -> str:
        return self.round_key(round_id, "ready")

    def coordinator(self, round_id: int) -> str:
        return self.round_key(round_id, "coordinator")

    def coordinator_beat(self, round_id: int) -> str:
        """The coordinator's lease: a sealed :class:`Beat` it renews every step."""
        return self.round_key(round_id, "coordinator_beat")

    def tick(self, round_id: int, number: int) -> str:
        """The coordinator's ``number``-th wake-up call to the round's waiters (they wait for the
        key on the store, server-side); its value is nothing, only that it exists. Forging one
        wakes waiters early, no more: they then read the sealed state."""
        return self.round_key(round_id, f"tick/{number}")

    def last_tick(self, round_id: int) -> str:
        """The number of the newest tick (a hint: a waiter that fell behind skips to it)."""
        return self.round_key(round_id, "last_tick")

    def roster_head(self, round_id: int) -> str:
        """The first participants of the round's arrivals log (a sealed list written when the
        round completed): readers need not read the whole log."""
        return self.round_key(round_id, "roster_head")

    def round_store_prefix(self, round_id: int) -> str:
        """Prefix of the store handed to the training job of this round (see :mod:`.round`)."""
        return self.round_key(round_id, "job")

    def finished(self, round_id: int) -> str:
        """The round's actives completed their work (a sealed marker; standbys of it are released)."""
        return self.round_key(round_id, "finished")

    def stage(self, round_id: int) -> str:
        """The stage a round is the first of (a sealed number): a script's fit()s, validate()s,
        test()s and predict()s are stages of one job, each starting with a new round; rounds
        opened after a failure have none and belong to the stage of the round before."""
        return self.round_key(round_id, "stage")

    def planned(self, round_id: int) -> str:
        """A round opened by a planned re-form, not a failure: a sealed word, ``hand_over`` (a
        signalled node left for a spare) or ``grow`` (an elastic job took in a node). Rounds after
        a failure have none; the run's figures count only those as recoveries."""
        return self.round_key(round_id, "planned")

    def exit_barrier(self, round_id: int) -> str:
        return f"{self.round_store_prefix(round_id)}/{EXIT_BARRIER_KEY}"

    def decided_rank(self, round_id: int, decision: str, participant_id: str) -> str:
        """A coordinator's answer for one participant, under its own decision: the ``ready`` marker
        names the decision in force, so answers of a coordinator that lost the race (or died
        half-way and was taken over) can never mix with the effective ones."""
        return self.round_key(round_id, f"decision/{decision}/{participant_id}")

    def heartbeat(self, participant_id: str) -> str:
        """A participant's heartbeat: a sealed number it raises every ``RendezvousSettings.heartbeat_every``."""
        return f"{self.prefix}/heartbeat/{participant_id}"

    def ack(self, participant_id: str) -> str:
        return f"{self.prefix}/ack/{participant_id}"


# ---------------------------------------------------------------------------- arrivals

_ARRIVED, _WITHDREW = "a1", "w1"


class ArrivalWriter(Protocol):
    @property
    def participant_id(self) -> str: ...
    @property
    def infra_rank(self) -> int: ...
    @property
    def domain_id(self) -> str: ...


class ArrivalRecord(NamedTuple):
    """One record of a round's arrivals log: a participant arrived, or withdrew.

    ``seq`` grows with every record a participant writes, so a reader keeps each participant's
    newest record and a replayed older one (an arrival copied after the withdrawal) changes
    nothing. A NamedTuple: the coordinator decodes every record of a round on each re-read.
    """

    withdrawn: bool
    seq: int
    infra_rank: int
    domain_id: str
    participant_id: str


def encode_arrival(seq: int, info: ArrivalWriter, withdrawn: bool = False) -> bytes:
    return SEP.join((_WITHDREW if withdrawn else _ARRIVED, str(seq), str(info.infra_rank),
                     info.domain_id, info.participant_id)).encode()


def decode_arrival(raw: bytes) -> ArrivalRecord | None:
    """Decode an arrival record; ``None`` for anything that is not a well-formed one."""
    try:
        kind, seq, infra, domain, participant_id = raw.decode().split(SEP)
        if kind not in (_ARRIVED, _WITHDREW) or not participant_id:
            return None
        return ArrivalRecord(kind == _WITHDREW, int(seq), int(infra), domain, participant_id)
    except (ValueError, UnicodeDecodeError):
        return None


class LostRecord(NamedTuple):
    """One record of the run's ``lost`` log: a participant lost for good, and why.

    ``silent_at``: for one judged dead by its silent heartbeat, the heartbeat number it stood
    still at (a higher one later shows it was only frozen and is back); None for one that left
    for good itself (withdrew, unhealthy)."""

    participant_id: str
    why: str
    silent_at: int | None = None


def encode_lost(participant_id: str, why: str, silent_at: int | None = None) -> str:
    parts = [participant_id, why.replace(SEP, " ")]
    return SEP.join(parts if silent_at is None else [*parts, str(silent_at)])


def decode_lost(raw: bytes) -> LostRecord | None:
    participant_id, sep, rest = raw.decode(errors="replace").partition(SEP)
    if not (sep and participant_id):
        return None
    why, sep, beat = rest.partition(SEP)
    return LostRecord(participant_id, why, int(beat) if sep and beat.isascii() and beat.isdigit() else None)


class Beat(NamedTuple):
    """A coordinator's lease renewal: who holds the lease, and how often it renewed it."""

    holder: str
    seq: int


def encode_beat(holder: str, seq: int) -> str:
    return SEP.join((holder, str(seq)))


def decode_beat(raw: bytes | None) -> Beat | None:
    if raw is None:
        return None
    holder, _, seq = raw.decode(errors="replace").partition(SEP)
    try:
        return Beat(holder, int(seq))
    except ValueError:
        return None


#: the answer rank of a participant the round has no place for (more than ``max_nodes`` arrived)
EXTRA_RANK = -2


class RankAnswer(NamedTuple):
    """The coordinator's answer for one participant: rank ``-1`` is standby, ``EXTRA_RANK`` extra."""

    round: int
    rank: int
    world_size: int


def encode_rank_answer(round_id: int, rank: int, world_size: int) -> str:
    return f"{round_id},{rank},{world_size}"


def decode_rank_answer(raw: bytes) -> RankAnswer | None:
    try:
        round_text, rank, world = raw.decode().split(",")
        return RankAnswer(int(round_text), int(rank), int(world))
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


#: how many participants a round's roster head names (the fail-over's first candidates)
ROSTER_HEAD = 8


def encode_roster_head(count: int, participant_ids: list[str]) -> str:
    return SEP.join([str(count), *participant_ids])


def decode_roster_head(raw: bytes | None) -> tuple[int, tuple[str, ...]] | None:
    """(how many participants the round's arrivals log holds, the first of them in log order)."""
    if raw is None:
        return None
    try:
        count_text, *ids = raw.decode().split(SEP)
        return int(count_text), tuple(ids)
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


def encode_log_versions(versions: list[int | str | None], continues_launch: bool = False) -> str:
    """The run's log versions; ``continues_launch``: they are an earlier launch's, continued."""
    return json.dumps({"versions": list(versions), "continues_launch": continues_launch})


def decode_log_versions(raw: bytes) -> tuple[list[int | str | None], bool]:
    """(versions, continues_launch); ([], False) for anything else."""
    try:
        value = json.loads(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return [], False
    if not isinstance(value, dict) or not isinstance(value.get("versions"), list):
        return [], False
    versions = [v for v in value["versions"] if v is None or isinstance(v, (int, str))]
    return versions, value.get("continues_launch") is True


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

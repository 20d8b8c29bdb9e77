"""Pure decisions of the ``ddp_ft`` strategy: no store, no clock, no torch.distributed.

The strategy reads the world (exceptions, store keys, timings) into plain values, asks one
of these functions, and performs the answer. Each function is deterministic so that the
rules can be tested with plain values.
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from lightning_ft.schema.run import CloseKind

# ------------------------------------------------------------------ hang detection


def hang_timeout(step_seconds: Sequence[float], floor: float, safety_factor: float) -> float:
    """Seconds a rank may go without progress before it counts as stuck.

    ``step_seconds`` are the durations of the steps completed so far in this round. The
    slowest recent step, not the mean, is scaled, so a workload with an occasional slow step
    (a snapshot, a logging step) does not trip the detector; ``floor`` keeps very fast steps
    from giving a hair trigger, and is the whole timeout before the first sample (the first
    step of a round, setup): a frozen peer or a deadlock is caught there too.
    """
    if not step_seconds:
        return floor
    return max(floor, safety_factor * max(step_seconds))


@dataclass(frozen=True)
class PeerState:
    """What one watchdog knows about a peer of its round."""

    rank: int
    #: training steps the peer completed in this round (as published by its watchdog)
    completed: int
    #: seconds since the peer's rendezvous heartbeat last moved (as observed here)
    silent_seconds: float
    #: where the peer waits inside a collective (as it published it), None when it is not in one
    waiting: str | None = None
    #: seconds the peer's published position (steps, activity, where it waits) has not changed
    still_seconds: float = 0.0


@dataclass(frozen=True)
class StallVerdict:
    """Which ranks a stall is blamed on (empty: nobody can be blamed yet); ``deadlock``: every
    rank waits in a collective and none moves -- they wait for each other."""

    stalled: tuple[int, ...]
    reason: str
    deadlock: bool = False


def find_stalled_ranks(own_rank: int, own_completed: int, peers: Iterable[PeerState], dead_after: float,
                       own_waiting: str | None = None, confirm_seconds: float = 0.0) -> StallVerdict:
    """Blame this rank's overdue progress on the ranks that stopped it.

    1. Peers whose heartbeat is silent for ``dead_after`` are frozen (SIGSTOP, a hung
       host, a network partition): they are blamed first.
    2. Otherwise, under DDP every rank enters each gradient all-reduce, so alive ranks are
       at most one step apart; a rank that completed fewer steps than the others stopped
       after the last all-reduce (stuck in ``optimizer.step``, a callback, I/O).
    3. All alive and level, and every rank -- this one too -- waits inside a collective
       with nothing moving for ``confirm_seconds``: a deadlock (ranks entered different
       collectives). Nobody is to blame; the round fails.
    4. Otherwise nobody can be told apart (a rank busy outside any collective: a long save,
       slow I/O) -- no verdict; the process-group timeout still bounds it.
    """
    peers = [p for p in peers if p.rank != own_rank]
    frozen = tuple(sorted(p.rank for p in peers if p.silent_seconds >= dead_after))
    if frozen:
        return StallVerdict(frozen, f"heartbeat of rank(s) {list(frozen)} silent for >= {dead_after:.2f}s")
    counts = {p.rank: p.completed for p in peers}
    counts[own_rank] = own_completed
    most = max(counts.values())
    behind = tuple(sorted(r for r, n in counts.items() if n < most and r != own_rank))
    if behind:
        return StallVerdict(behind, f"rank(s) {list(behind)} completed fewer steps than the others "
                                    f"({ {r: counts[r] for r in behind} } < {most})")
    if own_completed < most:
        return StallVerdict((), f"this rank (completed {own_completed}) is behind its peers ({most})")
    if own_waiting is not None and all(p.waiting is not None and p.still_seconds >= confirm_seconds
                                       for p in peers):
        where = "; ".join(f"rank {r}: {w}" for r, w in sorted([(own_rank, own_waiting),
                                                                 *((p.rank, p.waiting) for p in peers)]))
        return StallVerdict((), f"deadlock: every rank waits in a collective, level at {own_completed} step(s) "
                                f"of the round, and none moves ({where})", deadlock=True)
    return StallVerdict((), "every peer is alive and at the same step")


# ------------------------------------------------------------------ failures


class Detector(enum.Enum):
    """What noticed that a round failed."""

    #: a collective of this rank raised (a peer's connection closed, a timeout)
    COLLECTIVE = "collective"
    #: the round watchdog: a rank stopped progressing (frozen, behind, silent heartbeat)
    HANG = "hang"
    #: the round watchdog: every rank waits in a collective and none moves
    DEADLOCK = "deadlock"
    #: the round watchdog: a newer round opened while this rank trained (a peer saw a failure)
    RENDEZVOUS = "rendezvous"

    @property
    def judges_a_stall(self) -> bool:
        """The watchdog judged this round itself (and reported it when it fired)."""
        return self in (Detector.HANG, Detector.DEADLOCK)


class FailureKind(enum.Enum):
    #: a peer died, hung or left (collective failed; the rendezvous shows why)
    PEER_LOST = "peer_lost"
    #: the collective failed and nobody is known lost (network blip, timeout): re-form as is
    GROUP_BROKEN = "group_broken"
    #: every rank waited in a different collective (the watchdog broke the group): re-form
    #: from the snapshot, the path a relaunch takes; a deadlock that comes back is a bug
    DEADLOCK = "deadlock"
    #: a peer failed with an error of its own (a bug in training code): not recoverable
    PEER_ERROR = "peer_error"
    #: this process raised something that is not a collective failure: a bug, re-raise
    LOCAL_ERROR = "local_error"
    #: this node's resources failed (no space left, I/O error, read-only filesystem): not the
    #: user's bug; the node leaves as unhealthy (exit 82) and its peers recover without it
    NODE_FAULT = "node_fault"
    #: a deliberate stop (SIGTERM path, KeyboardInterrupt, SystemExit): let it through
    STOP = "stop"


@dataclass(frozen=True)
class FailureFacts:
    """What the strategy learned about an exception that ended a round's ``fit`` run."""

    exception_type: str
    is_collective_error: bool
    is_stop: bool = False
    #: a peer published a non-recoverable error of its own (text), else None
    peer_error: str | None = None
    #: the rendezvous opened a newer round (someone saw a failure first)
    newer_round: bool = False
    #: this process's watchdog blamed a hung peer
    hang_detected: bool = False
    #: this process's watchdog found every rank waiting in a collective, none moving
    deadlock_detected: bool = False
    #: members of the round whose heartbeat is already silent
    dead_members: tuple[str, ...] = ()
    #: the transport says the peer's end is gone (connection closed/reset by the peer)
    peer_gone: bool = False
    #: the errno name of a node-resource failure in the exception chain (see NODE_FAULT_ERRNOS)
    node_fault: str | None = None


#: OSError numbers that say "this node's storage failed", not "this program is wrong"
NODE_FAULT_ERRNOS = ("ENOSPC", "EDQUOT", "EIO", "EROFS")


def node_fault_errno(errnos: Iterable[int | None]) -> str | None:
    """The name of the first node-resource errno among ``errnos`` (an exception chain's), else None."""
    for number in errnos:
        name = errno.errorcode.get(number) if number is not None else None
        if name in NODE_FAULT_ERRNOS:
            return name
    return None


def classify_failure(facts: FailureFacts) -> FailureKind:
    """Peer failure (recover) or not (re-raise)?

    Only a failed collective can be a peer's fault. A peer that raised an error of its
    own publishes it before it exits, so its peers' collective errors are not mistaken
    for a lost node (a deterministic bug would otherwise consume every spare).
    """
    if facts.is_stop:
        return FailureKind.STOP
    if facts.node_fault is not None:
        return FailureKind.NODE_FAULT
    if not facts.is_collective_error and not facts.hang_detected and not facts.deadlock_detected:
        return FailureKind.LOCAL_ERROR
    if facts.peer_error is not None:
        return FailureKind.PEER_ERROR
    if facts.deadlock_detected:
        return FailureKind.DEADLOCK
    if facts.newer_round or facts.hang_detected or facts.dead_members or facts.peer_gone:
        return FailureKind.PEER_LOST
    return FailureKind.GROUP_BROKEN


_COLLECTIVE_ERROR_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError",
                           "ProcessGroupAbortedError", "GroupAbortedError")
_COLLECTIVE_ERROR_TEXT = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out waiting",
    "gloo", "nccl", "socket timeout", "connection refused", "econnreset", "epipe",
    "process group", "processgroup", "collective",
)


def looks_like_collective_error(chain: Iterable[tuple[str, str]]) -> bool:
    """Is any exception in ``chain`` (``(type name, message)`` pairs) a failed collective?

    torch raises ``DistBackendError`` / ``DistNetworkError`` for most transport failures,
    but gloo errors often surface as a plain ``RuntimeError`` whose text names the
    transport; both are recognised.
    """
    for type_name, message in chain:
        if type_name in _COLLECTIVE_ERROR_TYPES:
            return True
        text = message.lower()
        if type_name in ("RuntimeError", "OSError", "ConnectionError", "ConnectionResetError",
                         "BrokenPipeError", "TimeoutError") and any(k in text for k in _COLLECTIVE_ERROR_TEXT):
            return True
    return False


#: the words of the error an active raises when a peer fell silent before reaching the exit
#: barrier (runtime/exit_barrier.py): no transport saw it, the heartbeats did
PEER_SILENT_AT_EXIT = "fell silent before the exit barrier"
_PEER_GONE_TEXT = ("closed by peer", "reset by peer", "broken pipe", "connection refused", PEER_SILENT_AT_EXIT)


def looks_like_peer_gone(chain: Iterable[tuple[str, str]]) -> bool:
    """Does the transport report that the other end went away (process or host gone)?"""
    return any(any(k in message.lower() for k in _PEER_GONE_TEXT) for _, message in chain)


class FailureAction(enum.Enum):
    """What the recovery executor does about a failed round."""

    #: re-form the group (survivors and a spare) in a new round, inside the same fit()
    RECOVER = "recover"
    #: end fit() with the exception itself (a bug of this rank, a deliberate stop)
    RAISE = "raise"
    #: give up: exit NO_RESTART (83)
    NO_RESTART = "no_restart"
    #: this node's resources failed: leave as unhealthy, exit UNHEALTHY_NODE (82)
    UNHEALTHY = "unhealthy"
    #: a peer's failure: interrupt the round (callbacks see it), then decide again
    INTERRUPT = "interrupt"


@dataclass(frozen=True)
class FailureOutcome:
    """A decision about a failed round: the action, why, and what the others are told first."""

    action: FailureAction
    reason: str
    #: close the rendezvous for good with this kind before leaving (spares leave, peers learn why)
    close: CloseKind | None = None
    #: publish this rank's own error, so its peers do not mistake it for a lost node
    publish_error: bool = False


def decide_on_failure(kind: FailureKind) -> FailureOutcome:
    """The first decision, before anything is torn down: leave now, or interrupt the round and
    decide again (:func:`decide_after_interruption`) once the callbacks have seen it."""
    if kind is FailureKind.NODE_FAULT:
        return FailureOutcome(FailureAction.UNHEALTHY, "this node's storage failed; leaving as an unhealthy node")
    if kind is FailureKind.LOCAL_ERROR:
        return FailureOutcome(FailureAction.RAISE, f"{kind.value}: not a peer failure; re-raising",
                              close=CloseKind.FAILED, publish_error=True)
    if kind is FailureKind.STOP:
        return FailureOutcome(FailureAction.RAISE, f"{kind.value}: a deliberate stop; re-raising",
                              close=CloseKind.STOPPED)
    return FailureOutcome(FailureAction.INTERRUPT, f"{kind.value}: interrupting the round")


def decide_after_interruption(kind: FailureKind, termination_in_progress: bool, failures_without_progress: int,
                              max_failures_without_progress: int, recoveries: int,
                              max_recoveries: int | None, cannot_reform: str | None = None) -> FailureOutcome:
    """The second decision, once the callbacks saw the interruption: a termination in progress
    (the SIGTERM path decided in ``on_exception``) stops the job; else :func:`decide_recovery`."""
    if termination_in_progress:
        return FailureOutcome(FailureAction.RAISE, "a termination is in progress (SIGTERM path)",
                              close=CloseKind.STOPPED)
    return decide_recovery(kind, failures_without_progress, max_failures_without_progress, recoveries,
                           max_recoveries, cannot_reform)


def decide_recovery(kind: FailureKind, failures_without_progress: int,
                    max_failures_without_progress: int, recoveries: int,
                    max_recoveries: int | None, cannot_reform: str | None = None) -> FailureOutcome:
    """What to do about a classified failure of a peer.

    ``failures_without_progress`` counts failed rounds in a row that completed no training
    step beyond the step where the previous failure struck, including this one: a failure
    that recurs before any progress (a collective that fails deterministically, a spare that
    cannot start, a deadlock) must not loop forever. ``cannot_reform``: why the strategy
    cannot re-form a round in-process (sharded state, for now); such a failure ends the job.
    """
    if kind is FailureKind.STOP or kind is FailureKind.LOCAL_ERROR:
        return FailureOutcome(FailureAction.RAISE, f"{kind.value}: not a peer failure; re-raising")
    if kind is FailureKind.PEER_ERROR:
        return FailureOutcome(FailureAction.NO_RESTART,
                              "a peer failed with an error of its own; restarting would repeat it",
                              close=CloseKind.FAILED)
    if cannot_reform is not None:
        return FailureOutcome(FailureAction.NO_RESTART, f"{kind.value}: {cannot_reform}", close=CloseKind.FAILED)
    if failures_without_progress > max_failures_without_progress:
        return FailureOutcome(
            FailureAction.NO_RESTART,
            f"{failures_without_progress} failures in a row without a completed training step beyond the "
            f"previous failure (max_failures_without_progress={max_failures_without_progress}); the last one: "
            f"{kind.value}", close=CloseKind.FAILED)
    if max_recoveries is not None and recoveries >= max_recoveries:
        return FailureOutcome(FailureAction.NO_RESTART,
                              f"already recovered {recoveries} time(s) (max_recoveries={max_recoveries})",
                              close=CloseKind.FAILED)
    return FailureOutcome(FailureAction.RECOVER, f"{kind.value}: re-forming the group")


# ------------------------------------------------------------------ the end of the rendezvous


class Role(enum.Enum):
    """What a participant has been in the run so far, when the rendezvous ends for it."""

    #: active in some round: it trained
    TRAINED = "trained"
    #: a hot spare of a round that formed; never active
    STANDBY = "standby"
    #: no round formed while it waited (the job never started)
    UNASSIGNED = "unassigned"


class EndCause(enum.Enum):
    """Why the rendezvous ended for a participant."""

    #: the run was closed for good (its :class:`CloseKind` says why)
    CLOSED = "closed"
    #: no round formed within the join (or rejoin) timeout
    TIMED_OUT = "timed_out"
    #: the rendezvous store stopped answering
    STORE_LOST = "store_lost"
    #: SIGTERM arrived while this process waited in the rendezvous
    SIGTERM = "sigterm"
    #: a spare saw the actives pass torch's exit barrier (without a job secret) before the
    #: run's close was written
    ACTIVES_FINISHED = "actives_finished"


class EndAction(enum.Enum):
    #: return from fit() normally, exit code 0: the job finished, or a spare's work is done
    RETURN = "return"
    #: exit 143: stopped (by SIGTERM, here or elsewhere in the job), nothing of its own saved;
    #: the scheduler may requeue
    STOPPED = "stopped"
    #: exit NO_RESTART (83): the job cannot go on
    NO_RESTART = "no_restart"


def decide_on_rendezvous_end(role: Role, cause: EndCause, closed: CloseKind | None = None) -> EndAction:
    """The exit a participant owes the scheduler when the rendezvous ends for it.

    Exit 0 claims that the job finished (or, for a hot spare, that it has nothing to add):
    it is given only when the run closed FINISHED (or, without a secret, a spare saw the actives
    finish before that close was written), or to a spare of a formed round that lost the store
    -- the actives, which hold the training, report the job's outcome then. A
    SIGTERM, here or as the run's close, is 143 for everyone (stopped; requeue). Everything
    else -- no spare left, a peer's error, a close from outside, no round within the timeout,
    the store lost before anything trained or under a participant that trained -- is 83.
    """
    if cause is EndCause.SIGTERM:
        return EndAction.STOPPED
    if cause is EndCause.STORE_LOST:
        return EndAction.RETURN if role is Role.STANDBY else EndAction.NO_RESTART
    if cause is EndCause.TIMED_OUT:
        return EndAction.NO_RESTART
    if cause is EndCause.ACTIVES_FINISHED and closed is None:
        return EndAction.RETURN  # the close that will say FINISHED is not written yet
    if closed is CloseKind.FINISHED:
        return EndAction.RETURN
    if closed is CloseKind.STOPPED:
        return EndAction.STOPPED
    return EndAction.NO_RESTART


# ------------------------------------------------------------------ configuration helpers


def parse_nnodes(text: str, source: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max); the error names ``source``."""
    raw = str(text).strip()
    parts = raw.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"{source}={text!r} must be N or MIN:MAX (e.g. 2:3)") from None
    if low < 1 or high < low:
        raise ValueError(f"{source}={text!r} needs 1 <= MIN <= MAX")
    return low, high


def merge_setting(name: str, explicit: object, env_name: str, env_value: str | None,
                  parse: Callable[[str], object] = lambda v: v) -> object:
    """An explicit argument or its environment variable; both set and different is an error."""
    from_env = parse(env_value) if env_value not in (None, "") else None
    if explicit is not None and from_env is not None and explicit != from_env:
        raise ValueError(f"contradictory settings: {name}={explicit!r} but {env_name}={env_value!r}; "
                         f"set one of them")
    return explicit if explicit is not None else from_env


#: a rank's answer to "can the job start over from the failed round's start state?"
START_OVER_NO, START_OVER_YES, START_OVER_UNKNOWN = 0, 1, -1


def fit_already_finished(finished: tuple[int, int] | None, max_steps: int | None, max_epochs: int | None) -> bool:
    """Whether a ``fit()`` that stops at ``max_steps`` / ``max_epochs`` (-1 or None: no limit)
    would stop at once, its run's training having finished at ``finished`` = (step, epoch) (None:
    not recorded). A larger limit trains on (the user asked for more)."""
    if finished is None:
        return False
    step, epoch = finished
    return (max_steps is not None and max_steps >= 0 and step >= max_steps) or \
        (max_epochs is not None and max_epochs >= 0 and epoch >= max_epochs)


def may_start_over(votes: list[int]) -> bool:
    """Whether a sharded round whose shards no longer make up any step can start over from the
    state the failed round started with: every rank that trained in it says that state was the
    fit's own start (not a resumed snapshot, which only copies would bring back) and that it
    had sent no copy yet (after a copy, a lost rank's shards survive unless more was lost than
    the copies cover: starting over would hide that). Ranks that did not train in it (spares)
    have no say."""
    said = [vote for vote in votes if vote != START_OVER_UNKNOWN]
    return bool(said) and all(vote == START_OVER_YES for vote in said)


def elastic_accumulation(world_size: int, max_world_size: int, accumulation: int) -> tuple[int, str | None]:
    """Per-rank gradient accumulation that keeps an elastic job's global batch -- that of
    ``max_world_size`` ranks accumulating ``accumulation`` micro-batches each -- at ``world_size``
    ranks: ``(micro-batches per rank, None)`` when it divides evenly; else the nearest (at least 1)
    and what the global batch becomes."""
    total = max_world_size * accumulation
    if total % world_size == 0:
        return total // world_size, None
    nearest = max(1, round(total / world_size))
    return nearest, (f"the global batch of {total} micro-batches per optimizer step ({max_world_size} ranks x "
                     f"{accumulation}) does not split evenly over {world_size} ranks: {nearest} each, "
                     f"{nearest * world_size} micro-batches per step while the world is {world_size}")

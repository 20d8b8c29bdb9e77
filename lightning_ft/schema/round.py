"""Round scope: what the training job of one round keeps under the round's store prefix.

The rendezvous hands every round's job a prefix of its own (``RunKeys.round_store_prefix``),
so nothing written by one round is ever read by another. Keys here are relative to it.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from lightning_ft.schema.run import SEP

#: the process group's own rendezvous keys (``PrefixStore(f"{prefix}/{PROCESS_GROUP}", store)``)
PROCESS_GROUP = "pg"


def member_key(rank: int) -> str:
    """Who holds ``rank`` in this round (participant id and failure domain)."""
    return f"member/{rank}"


def progress_key(rank: int) -> str:
    """Training steps ``rank`` completed in this round (published by its watchdog)."""
    return f"progress/{rank}"


#: why the round failed, as the watchdog that broke it saw it (first writer wins): lets every
#: rank classify the failure alike, not only the one whose watchdog fired
VERDICT_KEY = "verdict"


class Verdict(NamedTuple):
    detector: str
    reason: str


def encode_verdict(detector: str, reason: str) -> str:
    return f"{detector}{SEP}{reason}"


def decode_verdict(raw: bytes) -> Verdict | None:
    detector, sep, reason = raw.decode(errors="replace").partition(SEP)
    return Verdict(detector, reason) if sep else None


def failed_key(rank: int) -> str:
    """The error text of a rank that failed with an error of its own (not recoverable)."""
    return f"failed/{rank}"


class Member(NamedTuple):
    participant_id: str
    domain_id: str


def encode_member(participant_id: str, domain_id: str) -> str:
    return f"{participant_id}{SEP}{domain_id}"


def decode_member(raw: bytes) -> Member:
    participant_id, _, domain = raw.decode(errors="replace").partition(SEP)
    return Member(participant_id, domain)


class Progress(NamedTuple):
    """What a rank's watchdog publishes: steps completed in the round, units of activity, and
    where it waits in a collective (only published once its own progress is overdue)."""

    completed: int
    activity: int = 0
    waiting: str | None = None


def encode_progress(completed: int, activity: int = 0, waiting: str | None = None) -> str:
    return SEP.join((str(int(completed)), str(int(activity)), waiting or ""))


def decode_progress(raw: bytes) -> Progress:
    try:
        completed, activity, waiting = raw.decode(errors="replace").split(SEP)
        return Progress(int(completed), int(activity), waiting or None)
    except ValueError:
        return Progress(0)


# ---------------------------------------------------------------------------- replicas
# With a job secret, rank 0 publishes a copy of its newest snapshot for hot spares while too
# few participants hold one (see lightning_ft.checkpoint.exchange.replication): a sealed meta
# that says what the copy is, and its bytes in encrypted chunks (lightning_ft.schema.encryption).

REPLICA_META_KEY = "replica/meta"
#: bytes of snapshot per stored chunk: one store value each, so a reader holds the snapshot
#: plus one chunk, and the store server never handles a value of the snapshot's whole size
REPLICA_CHUNK_BYTES = 16 << 20


def replica_chunk_key(step: int, index: int) -> str:
    """Chunk ``index`` of the replica of ``step``: each step's chunks have keys of their own, so
    a reader never mixes the chunks of two publications."""
    return f"replica/blob/{step}/{index}"


def replica_pullers_key(step: int | str) -> str:
    """Log of sealed records the spares append their puller ids to, to learn their place among the
    pullers of a step (a log, not a counter: bumping a counter could push every spare out)."""
    return f"replica/pullers/{step}"


class ReplicaMeta(NamedTuple):
    """What a published replica is, read before any of its bytes: a spare refuses a copy of
    another run or model, or one larger than it accepts, from this alone."""

    step: int
    #: failure domains of the round's actives, in rank order
    active_domains: tuple[str, ...]
    #: the identity recorded in the snapshot (the run id it was taken under, its model fingerprint)
    run_id: str
    model: str
    #: the snapshot's size and the bytes of each chunk (the last one may be shorter)
    nbytes: int
    chunk_bytes: int

    @property
    def chunks(self) -> int:
        return max(1, -(-self.nbytes // self.chunk_bytes))


def encode_replica_meta(meta: ReplicaMeta) -> str:
    return json.dumps({"step": meta.step, "domains": list(meta.active_domains), "run_id": meta.run_id,
                       "model": meta.model, "bytes": meta.nbytes, "chunk_bytes": meta.chunk_bytes},
                      separators=(",", ":"))


def decode_replica_meta(raw: bytes) -> ReplicaMeta | None:
    """The meta in ``raw``; None for anything malformed (wrong fields or types, negative sizes)."""
    try:
        record = json.loads(raw)
        domains = record["domains"]
        if not isinstance(domains, list):
            return None
        meta = ReplicaMeta(record["step"], tuple(domains), record["run_id"], record["model"], record["bytes"],
                           record["chunk_bytes"])
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None
    whole = (meta.step, meta.nbytes, meta.chunk_bytes)
    texts = (meta.run_id, meta.model, *meta.active_domains)
    if not (all(type(n) is int for n in whole) and all(isinstance(t, str) for t in texts)):
        return None
    if meta.step < 0 or meta.nbytes < 0 or meta.chunk_bytes <= 0:
        return None
    return meta


def work_key(rank: int) -> str:
    """``rank``'s own work and wait over its last steps (published by its watchdog; stragglers)."""
    return f"work/{rank}"


#: the rank the straggler policy evicted in this round, and why (first writer wins); read only
#: with a job secret (without one a store client could forge it: eviction then only warns)
EVICT_KEY = "evict"


class EvictionScope(NamedTuple):
    """What an eviction is bound to: the run, its incarnation, the round and the launch's random
    id. The seal binds the key (run, incarnation, round) already; the value names them all again
    so that one of an earlier launch under the same secret -- same run id and key on a fresh
    store -- does not count either."""

    run_id: str
    incarnation: int
    round_id: int
    launch_id: str


class Eviction(NamedTuple):
    rank: int
    step: int
    reason: str


def encode_work(step: int, count: int, median: float, low: float, wait: float) -> str:
    return json.dumps([step, count, round(median, 6), round(low, 6), round(wait, 6)])


def decode_work(raw: bytes) -> tuple[int, int, float, float, float] | None:
    """``(step, count, median, low, wait)``, or None for anything else (a damaged or foreign value)."""
    try:
        step, count, median, low, wait = json.loads(raw)
        return int(step), int(count), float(median), float(low), float(wait)
    except (ValueError, TypeError):
        return None


def encode_eviction(scope: EvictionScope, rank: int, step: int, reason: str) -> str:
    return json.dumps({"run": scope.run_id, "incarnation": scope.incarnation, "round": scope.round_id,
                       "launch": scope.launch_id, "rank": rank, "step": step, "reason": reason})


def decode_eviction(raw: bytes, scope: EvictionScope) -> Eviction | None:
    """The eviction in ``raw`` if it is one bound to ``scope``; None for anything else (a damaged
    value, or an eviction of another run, incarnation, round or launch)."""
    try:
        record = json.loads(raw)
        bound = EvictionScope(record["run"], record["incarnation"], record["round"], record["launch"])
        eviction = Eviction(record["rank"], record["step"], record["reason"])
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None
    numbers = (bound.incarnation, bound.round_id, eviction.rank, eviction.step)
    if bound != scope or not all(type(n) is int for n in numbers) or not isinstance(eviction.reason, str):
        return None
    return eviction

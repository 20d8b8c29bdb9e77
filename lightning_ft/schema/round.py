"""Round scope: what the training job of one round keeps under the round's store prefix.

The rendezvous hands every round's job a prefix of its own (``RunKeys.round_store_prefix``),
so nothing written by one round is ever read by another. Keys here are relative to it.
"""

from __future__ import annotations

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
# Rank 0 publishes a copy of its newest snapshot for hot spares while too few participants
# hold one (see lightning_ft.checkpoint.exchange.replication).

REPLICA_META_KEY = "replica/meta"
REPLICA_BLOB_KEY = "replica/blob"


def replica_pullers_key(step: int | str) -> str:
    """Counter the spares ``add`` to, to learn their index among the pullers of a step."""
    return f"replica/pullers/{step}"


class ReplicaMeta(NamedTuple):
    step: int
    #: failure domains of the round's actives, in rank order
    active_domains: tuple[str, ...]


def encode_replica_meta(step: int, active_domains: list[str] | tuple[str, ...]) -> str:
    return f"{step}{SEP}{','.join(active_domains)}"


def decode_replica_meta(raw: bytes) -> ReplicaMeta | None:
    try:
        step_text, _, domains_text = raw.decode().partition(SEP)
        return ReplicaMeta(int(step_text), tuple(domains_text.split(",")) if domains_text else ())
    except (ValueError, UnicodeDecodeError):
        return None

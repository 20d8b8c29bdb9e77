"""Termination scope: the SIGTERM path's stop step and unhealthy notices.

Keys live under ``lightning_ft/termination/<namespace>/`` on the process group's store; the
namespace is fresh for every ``fit()`` (chosen by rank 0), because stores outlive worker
groups (torchrun keeps one across restarts) and an old stop key must never stop a new run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

STOP_KEY = "stop"
UNHEALTHY_COUNT_KEY = "unhealthy_count"
#: a log (sealed records, one per rank) of the ranks that received the termination signal themselves
SIGNALLED_LOG = "signalled"
#: the hand-over verdict of this termination (first writer wins; every rank acts on the winner)
HAND_OVER_KEY = "hand_over"


def namespace_prefix(namespace: str) -> str:
    return f"lightning_ft/termination/{namespace}"


def unhealthy_key(rank: int) -> str:
    return f"unhealthy/{rank}"


def wake_key(rank: int) -> str:
    """Set (raw) to wake rank ``rank``'s stop watcher, which blocks in a store ``wait`` on it.

    Whoever writes the stop request or an unhealthy notice sets every rank's wake key after
    it; a rank sets its own to end its watcher. Not a value (anyone may set it): a woken
    watcher deletes it and reads the sealed keys, which decide.
    """
    return f"wake/{rank}"


def confirmed_key(rank: int) -> str:
    """Set (raw) by rank ``rank`` once it knows the stop request: "I will stop at its step".

    A rank that leaves as unhealthy sets it too (it will not hold anyone up). Not sealed: a
    forged confirmation can only make a rank miss the stop step and then fail in the next
    collective, where the exception path saves the same step.
    """
    return f"confirmed/{rank}"


@dataclass(frozen=True)
class StopRequest:
    """The agreed stop: every rank stops after optimizer step ``step``."""

    step: int
    rank: int  # who proposed it
    signum: int
    reason: str

    def encode(self) -> str:
        return json.dumps({"step": self.step, "rank": self.rank, "signum": self.signum, "reason": self.reason})

    @classmethod
    def decode(cls, raw: bytes | str) -> StopRequest:
        data = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        return cls(int(data["step"]), int(data["rank"]), int(data["signum"]), str(data["reason"]))


def encode_unhealthy(step: int, reasons: list[str]) -> str:
    return json.dumps({"step": step, "reasons": list(reasons)})


def decode_unhealthy(raw: bytes) -> list[str]:
    """The reasons a rank gave when it left as unhealthy."""
    return [str(r) for r in json.loads(raw.decode())["reasons"]]


def encode_signalled(rank: int) -> str:
    return json.dumps({"rank": rank})


def decode_signalled(raw: bytes) -> int | None:
    """The rank of a record of the signalled log; None for anything that is not one."""
    try:
        rank = json.loads(raw.decode())["rank"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return rank if type(rank) is int and rank >= 0 else None


@dataclass(frozen=True)
class HandOverVerdict:
    """Whether a termination is a hand-over: ``leavers`` leave, the others go on with spares in their
    places; no leavers: the whole job stops (the SIGTERM path as without spares)."""

    leavers: tuple[int, ...]
    reason: str

    @property
    def hands_over(self) -> bool:
        return bool(self.leavers)

    def encode(self) -> str:
        return json.dumps({"leavers": list(self.leavers), "reason": self.reason})

    @classmethod
    def decode(cls, raw: bytes | str) -> HandOverVerdict | None:
        """The verdict in ``raw``; None for a damaged value."""
        try:
            data = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            leavers, reason = data["leavers"], data["reason"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None
        if not isinstance(leavers, list) or not all(type(r) is int and r >= 0 for r in leavers) \
                or not isinstance(reason, str):
            return None
        return cls(tuple(leavers), reason)

"""Store fail-over scope: the keys a successor store is rebuilt and opened with.

They live outside every run's prefix (``lightning_ft_failover/``), under a *scope* of their own
per launch -- run id, incarnation and the launch's random id (:func:`failover_scope`) -- and are
never copied from one store to the next: each fail-over *epoch* (0 for the store the job started
with, then 1, 2, ...) has keys of its own, so nothing of an earlier fail-over is mistaken for this
one. Every value is sealed with the job secret (:class:`~lightning_ft.schema.signing.SealedStore`),
and a seal covers the full key: a value sealed for another run, incarnation, launch or epoch
(another job's, or one of an earlier launch under the same secret) does not verify here.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import NamedTuple

from lightning_ft.schema.run import SEP

PREFIX = "lightning_ft_failover"


def failover_scope(run_id: str, incarnation: int, launch_id: str) -> str:
    """The prefix of one launch's fail-over keys."""
    return f"{PREFIX}/{run_id}/i{incarnation}/{launch_id}"


def epoch_key(scope: str) -> str:
    """The epoch a store serves (a sealed number): a client that moves to a store checks it."""
    return f"{scope}/epoch"


def presence_key(run_prefix: str, participant_id: str) -> str:
    """Where ``participant_id`` announces its presence and successor endpoints (:func:`encode_presence`)."""
    return f"{run_prefix}/presence/{participant_id}"


class Announcement(NamedTuple):
    """What a participant announces when it joins: where its presence listener answers, and where
    it would serve the store if it became the successor (a port it holds from now on)."""

    presence: str
    successor: str


def encode_presence(presence: str, successor: str) -> str:
    return SEP.join((presence, successor))


def decode_presence(raw: bytes) -> Announcement | None:
    """The announcement in ``raw``, or None unless it is two endpoints (``host:port``)."""
    parts = raw.decode(errors="replace").split(SEP)
    if len(parts) != 2 or not all(_is_endpoint(part) for part in parts):
        return None
    return Announcement(parts[0], parts[1])


def _is_endpoint(text: str) -> bool:
    """``host:port`` (a printable host without spaces; a port in 1..65535, ASCII digits)."""
    host, sep, port = text.rpartition(":")
    return (bool(sep) and 0 < len(host) <= 255 and host.isascii() and host.isprintable() and " " not in host
            and 0 < len(port) <= 5 and all("0" <= c <= "9" for c in port) and 0 < int(port) < 65536)


class EpochKeys:
    """Keys of the fail-over into ``epoch``, in the launch's ``scope`` (see :func:`failover_scope`)."""

    def __init__(self, scope: str, epoch: int) -> None:
        self.prefix = p = f"{scope}/e{epoch}"
        #: log of :class:`Registration`: who reached the successor (its quorum counts them)
        self.registered = f"{p}/registered"
        #: the successor rebuilt the state and serves: participants go on (sealed text)
        self.open = f"{p}/open"
        #: the successor gave up (no quorum): why (sealed text)
        self.abandoned = f"{p}/abandoned"

    def view(self, participant_id: str) -> str:
        """What ``participant_id`` held of the lost store (see :func:`encode_view`)."""
        return f"{self.prefix}/view/{participant_id}"


class Registration(NamedTuple):
    participant_id: str
    #: it was active (held a rank) in the round it last took part in
    active: bool


def encode_registration(participant_id: str, active: bool) -> str:
    return SEP.join((participant_id, "active" if active else "standby"))


def decode_registration(raw: bytes) -> Registration | None:
    pid, sep, role = raw.decode(errors="replace").partition(SEP)
    if not sep or not pid or role not in ("active", "standby"):
        return None
    return Registration(pid, role == "active")


class ViewEntry(NamedTuple):
    """One key of a participant's view: ``kind`` is "value", "log" (lines of a sealed log) or "counter"."""

    kind: str
    value: bytes
    lines: tuple[bytes, ...] = ()


def encode_view(entries: dict[str, ViewEntry]) -> bytes:
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return json.dumps({key: [e.kind, b64(e.value), [b64(line) for line in e.lines]]
                       for key, e in entries.items()}, separators=(",", ":")).encode()


def decode_view(raw: bytes) -> dict[str, ViewEntry] | None:
    """A view, or None for anything that is not a well-formed one."""
    try:
        data = json.loads(raw)
        out = {}
        for key, (kind, value, lines) in data.items():
            if kind not in ("value", "log", "counter") or not isinstance(key, str):
                return None
            out[key] = ViewEntry(kind, base64.b64decode(value, validate=True),
                                 tuple(base64.b64decode(line, validate=True) for line in lines))
        return out
    except (ValueError, TypeError, binascii.Error, AttributeError):
        return None

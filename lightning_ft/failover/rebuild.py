"""Pure rules of a store fail-over: who may serve, and what the successor store holds.

No I/O here; :mod:`lightning_ft.failover.switchboard` reads the world, asks, and performs.

* :func:`may_serve` -- the quorum rule that keeps a partition from producing two stores that
  both decide.
* :func:`announced_store`, :func:`store_to_follow` -- where a participant may move: only to an
  endpoint a candidate announced, and, when its own store did not fail, only with a majority.
* :class:`Mirror` -- what one participant holds: every key it wrote or read (its *view*).
* :func:`merge_views` -- the successor's state, rebuilt from what the participants held.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from typing import Any, NamedTuple

from lightning_ft.schema.failover import PREFIX, ViewEntry
from lightning_ft.schema.signing import ABSENT, MAGIC, TAG_BYTES


class Verdict(NamedTuple):
    serve: bool
    #: why not (empty when ``serve``)
    reason: str = ""


def may_serve(participants: Collection[str], registered: Mapping[str, bool], dead: Collection[str],
              actives: Collection[str] = ()) -> Verdict:
    """Whether a successor with these registrations may open its store.

    ``participants``: the last round's participants (every candidate); ``registered``: who
    reached this successor -> whether it was active; ``dead``: participants whose host
    *refused* a connection to their presence port (their process is gone: the kernel says so),
    or whose port answered as some other process (a squatter: the participant is gone too); a
    frozen or unreachable one is not dead, it may come back.

    The rule: the registered are a strict majority of the participants not proven dead, and at
    least one of them was active -- or every one of ``actives`` (the last round's, as this
    successor knows them) is proven dead. Every participant registers with one successor per
    epoch, so two successors cannot both hold a majority of the same participants: a partition
    yields at most one store that decides, and the minority side ends truthfully. With no active
    alive, the spares go on from the newest snapshot they hold (a replica), if any; an active
    that may still be alive (frozen, unreachable) may be training on the other side of a
    partition, so without it nothing opens.
    """
    voters = [p for p in participants if p not in dead]
    reached = [p for p in voters if p in registered]
    all_actives_dead = bool(actives) and all(p in dead for p in actives)
    if not all_actives_dead and not any(registered.get(p, False) for p in reached):
        return Verdict(False, "no participant that was active reached the successor")
    if 2 * len(reached) <= len(voters):
        return Verdict(False, f"{len(reached)} of {len(voters)} participant(s) that may be alive reached it "
                              "(a majority is needed: a partition must not yield two stores)")
    return Verdict(True)


def announced_store(store: str, announced: Collection[str]) -> bool:
    """Whether ``store`` -- the endpoint a presence answer names -- is one that a candidate announced
    when it joined (read from the store while it lived). A participant moves to no other: not to
    one a presence answer made up (a squatter on a dead participant's presence port, without a job
    secret), nor to one a store names."""
    return bool(store) and store in announced


def store_to_follow(epoch: int, answers: Iterable[tuple[str, int, str]],
                    announced: Collection[str]) -> tuple[int, str] | None:
    """The newer store a participant that follows ``epoch`` moves to without having lost its own
    store: ``(epoch, endpoint)`` that a strict majority of the asked candidates not proven gone
    follow -- ``answers`` are their ``(state, epoch, store)``, state "dead", "silent" or "alive" --
    at an endpoint a candidate announced; None when there is no such majority.

    A majority, as for opening a successor (:func:`may_serve`): the answers of the few who could
    be impersonated (a squatter holds only a dead participant's ports) cannot outvote the living.
    """
    voters = [(state, e, store) for state, e, store in answers if state != "dead"]
    newer = Counter((e, store) for state, e, store in voters
                    if state == "alive" and e > epoch and announced_store(store, announced))
    if not newer:
        return None
    (best, where), count = max(newer.items(), key=lambda item: (item[1], item[0][0]))
    return (best, where) if 2 * count > len(voters) else None


def follow_settled(epoch: int, answers: Iterable[tuple[str, int, str]], asked: int,
                   announced: Collection[str]) -> bool:
    """Whether the ``answers`` of some of the ``asked`` candidates already rule out a move (for
    :func:`store_to_follow`), whatever the others answer: when at least half of all asked are
    voters that name no newer announced store, no newer store can win a strict majority of the
    voters. Lets a participant ask half of the candidates in the common case (nobody moved)."""
    staying = sum(1 for state, e, store in answers
                  if state != "dead" and not (state == "alive" and e > epoch and announced_store(store, announced)))
    return 2 * staying >= asked


def _number(value: bytes) -> int | None:
    """The non-negative number a (sealed or plain) value holds, or None."""
    data = value[len(MAGIC) + TAG_BYTES:] if value.startswith(MAGIC) else value
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None
    return int(text) if text.isdigit() else None


def _log_lines(entry: ViewEntry) -> list[bytes]:
    lines = [line for line in entry.value.split(b"\n") if line] if entry.kind in ("log", "value") else []
    return lines + [line for line in entry.lines if line not in lines]


def is_log(entry: ViewEntry) -> bool:
    # a sealed log is framed "\n<record>\n" per record (SealedStore.append)
    return entry.kind == "log" or (entry.kind == "value" and entry.value.startswith(b"\n"))


def merge_views(views: Iterable[Mapping[str, ViewEntry]]) -> dict[str, bytes]:
    """The successor store's content from every participant's view (the successor's own first).

    Per key: a log is the union of its lines (every view holds a prefix of the log plus its
    own appends; readers tolerate a record seen twice and order does not decide a record's
    meaning beyond each writer's own sequence numbers); a counter is the highest count seen;
    a value that holds a number (round, incarnation, heartbeats: sealed numbers only rise) is
    the highest; any other value is the first view's.
    """
    grouped: dict[str, list[ViewEntry]] = {}
    for view in views:
        for key, entry in view.items():
            grouped.setdefault(key, []).append(entry)
    merged: dict[str, bytes] = {}
    for key, entries in grouped.items():
        if any(is_log(e) for e in entries):
            lines: list[bytes] = []
            seen: set[bytes] = set()
            for entry in sorted(entries, key=lambda e: -len(e.value)):
                for line in _log_lines(entry):
                    if line not in seen:
                        seen.add(line)
                        lines.append(line)
            merged[key] = b"".join(b"\n" + line + b"\n" for line in lines)
        elif all(e.kind == "counter" for e in entries):
            merged[key] = str(max(_number(e.value) or 0 for e in entries)).encode()
        else:
            numbered = [(n, e.value) for e in entries if (n := _number(e.value)) is not None]
            if len(numbered) == len(entries):
                merged[key] = max(numbered, key=lambda nv: nv[0])[1]
            else:
                merged[key] = entries[0].value
    return merged


#: values larger than this are not kept for a successor (snapshot replicas: republished anyway)
MIRROR_VALUE_LIMIT = 64 * 1024


class Mirror:
    """Every store key this process wrote or read, with the value it knows: its *view*.

    A log (``SealedStore.append``) keeps the last full value read plus the records this
    process appended since; large values (snapshot replicas) and the fail-over's own keys are
    not kept.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, ViewEntry] = {}

    @staticmethod
    def _bytes(value: Any) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def _keep(self, key: str) -> bool:
        return not key.startswith(PREFIX)

    def saw(self, key: str, value: Any) -> None:
        data = self._bytes(value)
        if not self._keep(key) or len(data) > MIRROR_VALUE_LIMIT:
            return
        with self._lock:
            held = self._values.get(key)
            if held is not None and held.kind == "log":
                self._values[key] = ViewEntry("log", data, tuple(ln for ln in held.lines if ln not in data))
            else:
                self._values[key] = ViewEntry("value", data)

    def appended(self, key: str, value: Any) -> None:
        if not self._keep(key):
            return
        lines = tuple(line for line in self._bytes(value).split(b"\n") if line)
        with self._lock:
            held = self._values.get(key)
            base = held.value if held is not None and held.kind in ("log", "value") else b""
            self._values[key] = ViewEntry("log", base, (held.lines if held is not None else ()) + lines)

    def counted(self, key: str, count: int) -> None:
        if self._keep(key):
            with self._lock:
                self._values[key] = ViewEntry("counter", str(int(count)).encode())

    def dropped(self, key: str) -> None:
        with self._lock:
            self._values.pop(key, None)

    def view(self) -> dict[str, ViewEntry]:
        with self._lock:
            return dict(self._values)

    def record(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        """Keep what the store call ``name(*args)`` that returned ``result`` tells of the store."""
        if name == "set":
            self.saw(args[0], args[1])
        elif name == "compare_set":
            if self._bytes(result) != ABSENT:  # else a read of a key that is not there (get_if_present)
                self.saw(args[0], result)
        elif name == "get":
            self.saw(args[0], result)
        elif name == "multi_get":
            for key, value in zip(args[0], result, strict=False):
                self.saw(key, value)
        elif name == "multi_set":
            for key, value in zip(args[0], args[1], strict=False):
                self.saw(key, value)
        elif name == "append":
            self.appended(args[0], args[1])
        elif name == "add":
            self.counted(args[0], result)
        elif name == "delete_key":
            self.dropped(args[0])

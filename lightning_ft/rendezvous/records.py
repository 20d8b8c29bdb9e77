"""The run's sealed state on the store: every read and write that can decide an outcome.

*Counters are hints, sealed records are truth.* A store client can ``add`` to any key, and a
counter cannot be sealed; so nothing here trusts one. The round and the incarnation are sealed
numbers moved on with ``compare_set`` on their exact bytes (``add`` cannot even parse them);
who arrived in a round, who withdrew and who is lost for good are sealed records appended to
logs; heartbeats and the coordinator's lease are sealed numbers that must *rise* to count. A
value that fails its check is ignored and logged once per kind of key
(:class:`~lightning_ft.schema.signing.Signer`), and error messages name those kinds.

Without a job secret nothing is authenticated (values pass through unsealed), as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

from lightning_ft.deadlines import StoreClient
from lightning_ft.rendezvous.decisions import Arrival, arrivals_of_round, choose_incarnation
from lightning_ft.rendezvous.liveness import came_back
from lightning_ft.schema.run import (
    LAUNCH_KEY,
    SEP,
    ArrivalWriter,
    Beat,
    CloseReason,
    LostRecord,
    RunKeys,
    decode_arrival,
    decode_beat,
    decode_coordinator,
    decode_last_actives,
    decode_lost,
    decode_number,
    encode_arrival,
    encode_beat,
    encode_coordinator,
    encode_lost,
    encode_number,
    incarnation_key,
    is_launch_id,
    new_launch_id,
)
from lightning_ft.schema.signing import SealedStore, Signer, get_if_present
from lightning_ft.store.locator import NoRunningJob

log = logging.getLogger(__name__)


class CompletedRound(Protocol):
    """What :meth:`RunRecords.census` needs of a round's result."""

    @property
    def round(self) -> int: ...

    @property
    def world_size(self) -> int: ...


class HandOverCensus(NamedTuple):
    """See :meth:`RunRecords.census`."""

    #: live hot spares that could take a place now
    spares: int
    #: (rank, participant id) of each active of the round whose heartbeat stood still
    silent_actives: tuple[tuple[int, str], ...]


class RunRecords:
    """One process's view of a run incarnation's sealed state on one store connection."""

    def __init__(self, store: StoreClient, signer: Signer, keys: RunKeys) -> None:
        self.store = store
        self.signer = signer
        self.keys = keys
        self.values = SealedStore(store, signer)
        self._round_seen = 0
        self._line_cache: dict[bytes, bytes | None] = {}
        self._launch_id: str | None = None

    @property
    def launch_id(self) -> str:
        """This launch's random id (see :func:`read_launch_id`), read on first use -- when the
        participant joins, with a store fail-over; else with its first round -- and kept."""
        if self._launch_id is None:
            self._launch_id = read_launch_id(self.store, self.signer)
        return self._launch_id

    # ----------------------------------------------------------------- the round

    def current_round(self) -> int:
        """The current round: the authentic number in the store, never lower than one seen before
        (a replayed older value cannot move anyone back). Creates round 0 on first use."""
        key = self.keys.round
        raw = self.store.compare_set(key, "", self.signer.seal(key, encode_number(0)))
        value = decode_number(self.signer.open(key, bytes(raw)))
        if value is not None and value > self._round_seen:
            self._round_seen = value
        return self._round_seen

    def open_round(self, round_id: int) -> int:
        """Move the current round on to ``round_id`` unless it is there or beyond; returns the round
        in force. Idempotent: concurrent callers agree (the sealed bytes of a number are the same
        for everyone); a value that fails its check is replaced."""
        def at_or_beyond(raw: bytes) -> bool:
            held = decode_number(raw)
            return held is not None and held >= round_id

        held = self.values.replace(self.keys.round, at_or_beyond, encode_number(round_id))
        value = decode_number(held)
        self._round_seen = max(self._round_seen, value if value is not None else round_id)
        return self._round_seen

    # ----------------------------------------------------------------- arrivals

    def append_arrival(self, round_id: int, seq: int, info: ArrivalWriter, withdrawn: bool = False) -> None:
        """Record that ``info`` arrived in (or withdrew from) ``round_id``; ``seq`` must grow per writer."""
        self.values.append(self.keys.arrivals(round_id), encode_arrival(seq, info, withdrawn))
        # a hint for readers, nothing more: set, not ``add`` -- ``add`` on a value a store client
        # garbled would make the server drop this connection
        self.store.set(self.keys.appended(round_id), f"{info.participant_id}{SEP}{seq}")

    def appended_hint(self, round_id: int) -> bytes:
        """The last appender's mark on the arrivals log of ``round_id``: readers re-read the log when
        it changes (a forged mark costs a re-read, nothing else)."""
        return get_if_present(self.store, self.keys.appended(round_id)) or b""

    def arrivals(self, round_id: int) -> tuple[Arrival, ...]:
        """The live arrivals of ``round_id``, in log order (see :func:`arrivals_of_round`)."""
        records = self.values.records(self.keys.arrivals(round_id), self._line_cache)
        return arrivals_of_round([decode_arrival(r) for r in records])

    def finish_round(self, round_id: int) -> None:
        """Record that the actives of ``round_id`` completed their work (idempotent)."""
        self.values.put_if_absent(self.keys.finished(round_id), encode_number(round_id))

    def round_finished(self, round_id: int) -> bool:
        """Whether the actives of ``round_id`` completed their work (an authentic marker)."""
        return round_id >= 0 and self.values.get(self.keys.finished(round_id)) is not None

    def label_stage(self, round_id: int, stage: int) -> int:
        """Make ``round_id`` the first round of ``stage`` unless it is labelled already; returns its label."""
        held = decode_number(self.values.put_if_absent(self.keys.stage(round_id), encode_number(stage)))
        return held if held is not None else stage

    def stage_label(self, round_id: int) -> int | None:
        """The stage ``round_id`` is the first of (None: it is not the first round of a stage)."""
        return decode_number(self.values.get(self.keys.stage(round_id)))

    def mark_planned(self, round_id: int, why: str) -> None:
        """Record that ``round_id`` is opened by a planned re-form (``hand_over``, ``grow``), not a
        failure; the first record stands."""
        self.values.put_if_absent(self.keys.planned(round_id), why)

    def planned(self, round_id: int) -> str | None:
        """Why ``round_id`` was opened when it was planned (see :meth:`mark_planned`); None: after a
        failure, or the first round of the job or a stage."""
        raw = self.values.get(self.keys.planned(round_id))
        return raw.decode(errors="replace") if raw is not None else None

    def closed_for_good(self) -> bytes | None:
        """The authentic close reason of this incarnation (encoded), or None while it is open."""
        return self.values.get(self.values.unlisted(self.keys.closed_for_good))

    # ----------------------------------------------------------------- lost for good

    def lost(self) -> dict[str, str]:
        """Participants lost for good (dead, unhealthy, withdrawn) -> the first reason recorded."""
        return {pid: record.why for pid, record in self.lost_records().items()}

    def lost_records(self) -> dict[str, LostRecord]:
        """Participants lost for good -> the first record of them (see ``LostRecord``)."""
        lost: dict[str, LostRecord] = {}
        for raw in self.values.records(self.keys.lost, self._line_cache):
            record = decode_lost(raw)
            if record is not None:
                lost.setdefault(record.participant_id, record)
        return lost

    def spares_of_round(self, round_id: int, actives: int) -> int:
        """Hot spares that could take a place now: live participants of ``round_id`` beyond its ``actives``."""
        lost = self.lost()
        live = [a for a in self.arrivals(round_id) if a.participant_id not in lost]
        return max(0, len(live) - actives)

    def census(self, result: CompletedRound, heartbeat_every: float,
               sleep: Callable[[float], None] = time.sleep) -> HandOverCensus:
        """Who could hand over and who could take over in ``result``'s round, by liveness: the
        :meth:`spares_of_round` whose heartbeat rose within two heartbeat intervals (read, wait,
        read again: a spare that died a moment ago is still an arrival, and not yet lost, but it
        must not be handed a place), and the round's actives whose heartbeat did not (a rank that
        died a moment ago must not be counted on to carry the state on). One read of the round's
        actives and two of the heartbeats."""
        round_id, actives = result.round, result.world_size
        lost = self.lost()
        live = [a.participant_id for a in self.arrivals(round_id) if a.participant_id not in lost]
        ranked = self.ranked_actives(round_id)
        standby = [pid for pid in live if pid not in ranked]
        still = set(self.not_beating([*standby, *ranked], 2 * heartbeat_every, sleep))
        beating = [pid for pid in standby if pid not in still]
        silent = tuple((rank, pid) for rank, pid in enumerate(ranked) if pid in still)
        return HandOverCensus(min(len(beating), max(0, len(live) - actives)), silent)

    def ranked_actives(self, round_id: int) -> tuple[str, ...]:
        """The actives of ``round_id`` in rank order, as its decision recorded them (empty when
        the record is of another round or absent)."""
        raw = self.values.get(self.keys.last_actives)
        last = decode_last_actives(raw) if raw is not None else None
        return last[1] if last is not None and last[0] == round_id else ()

    def no_place_for(self, round_id: int, participant_id: str, max_nodes: int, watch: float,
                     sleep: Callable[[float], None] = time.sleep) -> bool:
        """Whether ``max_nodes`` live participants hold places ahead of ``participant_id``, a late
        arrival of ``round_id`` (the places of standby participants that died meanwhile are freed
        first: :meth:`free_dead_standby_places`, each heartbeat watched for ``watch`` seconds)."""
        ids = [a.participant_id for a in self.arrivals(round_id)]
        if participant_id not in ids:
            return False
        lost = self.lost()
        ahead = [pid for pid in ids[:ids.index(participant_id)] if pid not in lost]
        if len(ahead) < max_nodes:
            return False
        return len(ahead) - self.free_dead_standby_places(round_id, ahead, watch, participant_id, sleep) >= max_nodes

    def free_dead_standby_places(self, round_id: int, participant_ids: Sequence[str], watch: float, by: str,
                                 sleep: Callable[[float], None] = time.sleep) -> int:
        """Record as lost the standby participants among ``participant_ids`` (not ranked in
        ``round_id``) whose heartbeat did not rise within ``watch`` seconds; returns how many.

        Why: a spare SIGKILLed while it stood by is noticed by nobody -- no collective of its fails
        -- and its arrival holds a place: the replacement its scheduler starts (``by``) was turned
        away as extra, and the job ran a spare short for good. The round's actives are never
        judged here (their watchdogs do, with their own thresholds). Recorded without the beat it
        stood at: unlike a frozen active judged by its silence (:func:`~.liveness.came_back`), a
        spare frozen that long and thawed later does not count as back."""
        ranked = self.ranked_actives(round_id)
        dead = self.not_beating([pid for pid in participant_ids if pid not in ranked], watch, sleep)
        for pid in dead:
            self.mark_lost(pid, f"heartbeat silent for {watch:g}s while standing by (found by {by}, which "
                                "arrived to replace a node)")
        if dead:
            log.warning("%s: standby participant(s) %s of round %d are gone (heartbeat silent for %gs): their places "
                        "are free", by, dead, round_id, watch)
        return len(dead)

    def not_beating(self, participant_ids: Sequence[str], watch: float,
                    sleep: Callable[[float], None] = time.sleep) -> list[str]:
        """Those of ``participant_ids`` whose heartbeat did not rise within ``watch`` seconds (read,
        wait, read again): dead or frozen. Two reads of the heartbeats, whatever their number."""
        if not participant_ids:
            return []
        before = self.heartbeats(participant_ids)
        sleep(watch)
        after = self.heartbeats(participant_ids)
        return [pid for pid in participant_ids if not _rose(before[pid], after[pid])]

    def mark_lost(self, participant_id: str, why: str, silent_at: int | None = None) -> bool:
        """Record ``participant_id`` as lost for good (``silent_at``: the heartbeat number it stood
        still at, when its silence judged it); False when it already was. Racing writers may both
        append: readers count a participant once."""
        if participant_id in self.lost():
            return False
        self.values.append(self.keys.lost, encode_lost(participant_id, why, silent_at))
        return True

    def not_back(self, lost: dict[str, LostRecord]) -> int:
        """How many of ``lost`` are still lost: all but those judged by a silent heartbeat whose
        heartbeat has risen since (they were frozen, not dead, and wait as spares now)."""
        judged = [pid for pid, record in lost.items() if record.silent_at is not None]
        beats = self.heartbeats(judged) if judged else {}
        return sum(1 for pid, record in lost.items() if not came_back(record, beats.get(pid)))

    # ----------------------------------------------------------------- heartbeats and the lease

    def heartbeat(self, participant_id: str) -> int | None:
        """``participant_id``'s authentic heartbeat number (None: absent or not authentic)."""
        return decode_number(self.values.get(self.keys.heartbeat(participant_id)))

    def heartbeats(self, participant_ids: Iterable[str]) -> dict[str, int | None]:
        """The heartbeat numbers of ``participant_ids``: two store requests when every one has
        beaten (the usual case), else one per participant."""
        ids = list(participant_ids)
        raws = self.values.multi_get_if_all_present([self.keys.heartbeat(pid) for pid in ids])
        if raws is None:
            return {pid: self.heartbeat(pid) for pid in ids}
        return {pid: decode_number(raw) for pid, raw in zip(ids, raws, strict=True)}

    def claim_coordinator(self, round_id: int, participant_id: str) -> str | None:
        """Try to become the coordinator of ``round_id`` (the first claim wins); returns the holder
        of the claim in force (None: it does not decode)."""
        held = self.values.put_if_absent(self.keys.coordinator(round_id), encode_coordinator(participant_id))
        claim = decode_coordinator(held.decode(errors="replace"))
        return claim[0] if claim is not None else None

    def coordinator(self, round_id: int) -> tuple[bytes, tuple[str, tuple[str, ...]] | None]:
        """``(raw bytes, (holder, replaced) or None)`` of the coordinator claim of ``round_id``:
        None when absent or not authentic (then anyone may replace it)."""
        key = self.keys.coordinator(round_id)
        raw = get_if_present(self.store, key) or b""
        opened = self.signer.open(key, raw) if raw else None
        return raw, decode_coordinator(opened.decode(errors="replace")) if opened is not None else None

    def take_over_coordinator(self, round_id: int, seen: bytes, participant_id: str,
                              replaced: tuple[str, ...]) -> bool:
        """Replace the claim ``seen`` (the raw bytes read) by ours; True when ours is in force."""
        key = self.keys.coordinator(round_id)
        mine = self.signer.seal(key, encode_coordinator(participant_id, replaced))
        return bytes(self.store.compare_set(key, seen, mine)) == mine

    def renew_lease(self, round_id: int, holder: str, seq: int) -> None:
        self.values.put(self.keys.coordinator_beat(round_id), encode_beat(holder, seq))

    def lease(self, round_id: int) -> Beat | None:
        """The coordinator's newest authentic lease renewal (None: none, or not authentic)."""
        return decode_beat(self.values.get(self.keys.coordinator_beat(round_id)))

    # ----------------------------------------------------------------- shutdown acknowledgements

    def acknowledge(self, participant_id: str) -> None:
        self.values.put(self.keys.ack(participant_id), "1")

    def acknowledged(self, participant_ids: Iterable[str], all_or_none: bool = False) -> set[str]:
        """Which of ``participant_ids`` acknowledged shutdown with an authentic value.

        ``all_or_none``: one request while not all of them wrote something (for a poll loop).
        """
        ids = list(participant_ids)
        names = [self.keys.ack(pid) for pid in ids]
        if not names:
            return set()
        if self.store.check(names):
            return {pid for pid, value in zip(ids, self.values.multi_get(names), strict=True) if value is not None}
        if all_or_none:
            return set()
        return {pid for pid, name in zip(ids, names, strict=True) if self.values.get(name) is not None}


def publish_launch_id(store: StoreClient, signer: Signer) -> str:
    """Make this launch's id and write it, overwriting whatever is there: by whoever hosts the
    store, right after it starts listening (before any participant of this launch can have read
    one). Returns it."""
    launch_id = new_launch_id()
    SealedStore(store, signer).put(LAUNCH_KEY, launch_id)
    return launch_id


def read_launch_id(store: StoreClient, signer: Signer) -> str:
    """This launch's id, as its store holds it: the authentic one there, else (no store host wrote
    one, or the value there fails its check) a fresh one -- the first writer wins, so every
    participant reads the same. A participant reads it once, when it joins."""
    values = SealedStore(store, signer)
    held = values.get(LAUNCH_KEY)  # one request, as a rule: the store's host wrote it
    if held is None or not is_launch_id(held):
        held = values.replace(LAUNCH_KEY, is_launch_id, new_launch_id())
    return held.decode()


def current_incarnation(store: StoreClient, signer: Signer, run_id: str) -> int | None:
    """The run's newest incarnation as an authentic number (0 when none was opened yet); None
    when the value there fails its check."""
    key = incarnation_key(run_id)
    raw = store.compare_set(key, "", signer.seal(key, encode_number(0)))
    return decode_number(signer.open(key, bytes(raw)))


def resolve_incarnation(store: StoreClient, signer: Signer, run_id: str, started_at: float,
                        rejoin: bool = False) -> int:
    """The incarnation of ``run_id`` a participant started at ``started_at`` belongs to (see
    :func:`~lightning_ft.rendezvous.decisions.choose_incarnation`); opens the next one if needed --
    except for a node restarted to ``rejoin`` its running job: when that job was closed for good
    before this process started (its store still serves a moment after the end), it raises
    :class:`~lightning_ft.store.locator.NoRunningJob` instead of starting the run again.

    The incarnation is a sealed number: a store client can neither bump it (``add`` cannot
    parse it) nor forge one. A value that fails its check is replaced by the number this
    participant can prove: the newest incarnation with an authentic round (see below).
    """
    values = SealedStore(store, signer)
    found = current_incarnation(store, signer, run_id)
    if found is None:
        found = _newest_authentic_incarnation(values, run_id)
        log.warning("run %s: the incarnation number in the store fails its check; using %d, the newest "
                    "incarnation with an authentic round", run_id, found)
        _move_incarnation(values, run_id, found)
    current = found
    while True:
        raw = values.get(values.unlisted(RunKeys(run_id, current).closed_for_good))
        closed = CloseReason.decode(raw) if raw is not None else None
        chosen = choose_incarnation(current, closed.closed_at if closed is not None else None, started_at)
        if chosen == current:
            return current
        if rejoin:
            raise NoRunningJob(f"run {run_id!r}: its job ended ({closed}) before this process started: there is "
                               "no running job to rejoin")
        held = _move_incarnation(values, run_id, chosen)
        if held == chosen:
            log.info("run %s: incarnation %d was closed for good (%s) before this process started; this is "
                     "a new launch of the run id: incarnation %d", run_id, current, closed, chosen)
        current = held if held is not None else chosen  # judge the one in force (it may be closed too)


def _move_incarnation(values: SealedStore, run_id: str, incarnation: int) -> int | None:
    """Move the run's incarnation on to ``incarnation`` unless it is there or beyond; the one in force."""
    def at_or_beyond(raw: bytes) -> bool:
        held = decode_number(raw)
        return held is not None and held >= incarnation

    return decode_number(values.replace(incarnation_key(run_id), at_or_beyond, encode_number(incarnation)))


def _newest_authentic_incarnation(values: SealedStore, run_id: str, limit: int = 10_000) -> int:
    newest = 0
    for incarnation in range(limit):
        if values.get(RunKeys(run_id, incarnation).round) is None:
            break
        newest = incarnation
    return newest


def _rose(before: int | None, after: int | None) -> bool:
    """A heartbeat read twice: it rose (or appeared) in between."""
    return after is not None and (before is None or after > before)

"""Who is alive, judged by sealed heartbeats: the one liveness rule of the package.

A participant's heartbeat thread raises a sealed number every heartbeat interval. A reader counts
a beat only when the number *rises* above the highest it saw: a replayed older value, or one that
fails its check, is silence (a store client without the job secret cannot keep a dead peer
alive). The rendezvous coordinator (previous actives that did not come back), the round
watchdog (a frozen peer) and a hot spare (every active silent) all ask this tracker, each with
its own threshold; every threshold is derived from the one primary setting ``heartbeat_interval``
(and the job's size) by :class:`LivenessThresholds`:

=======================  ===========================================  ===============================
threshold                formula                                      who judges by it
=======================  ===========================================  ===============================
``heartbeat_every``      ``max(heartbeat_interval, max_nodes/2500)``  every participant beats this
                                                                      often
``dead_after``           ``4 x heartbeat_every``                      the coordinator: a previous
                                                                      active that did not come back
                                                                      is lost, when its process is
                                                                      proven gone (its presence
                                                                      port refuses connections)
``unproven_dead_after``  ``max(dead_after, 2 s)``                     the same without that proof (a
                                                                      frozen or starved process, an
                                                                      unreachable host)
``takeover_after``       ``max(dead_after, 2 s)``                     a waiter replaces a silent
                                                                      coordinator
``frozen_peer_after``    ``max(5 x dead_after, 2 s)``                 the round watchdog: a peer
                                                                      whose heartbeat stood still
                                                                      this long while this rank
                                                                      cannot progress is frozen
                                                                      (SIGSTOP, a hung host)
``all_silent_after``     ``max(dead_after, 3 s)``                     a hot spare opens the next
                                                                      round when every active is
                                                                      this silent
=======================  ===========================================  ===============================

The floors keep a loaded machine from looking like a dead one: work that holds the GIL kept every
heartbeat thread of a job from running for about a second at the start of training (seen on 2
cores; a process of 32 participants on a loaded 2-core machine once went 0.4 s without a beat
and lost them all their places), and a coordinator replaced again and again keeps a round from
completing. A process that ended is told apart at once: its presence port refuses. The hang
timeout of a step is the other primary setting, ``hang_timeout_floor`` (see
``lightning_ft.runtime.decisions.hang_timeout``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from lightning_ft.schema.run import LostRecord

#: all heartbeats of a job together stay near this many store requests per second
HEARTBEATS_PER_SECOND = 2500.0
#: the shortest heartbeat silence after which a previous active not proven gone is judged dead
UNPROVEN_DEAD_FLOOR = 2.0
#: the shortest lease silence after which a coordinator is replaced (see the module docstring)
TAKEOVER_FLOOR = 2.0
#: the shortest heartbeat silence after which the round watchdog judges a peer frozen
FROZEN_PEER_FLOOR = 2.0
#: the shortest silence of every active after which a hot spare opens the next round
ALL_SILENT_FLOOR = 3.0


@dataclass(frozen=True)
class LivenessThresholds:
    """Every threshold that judges a participant dead, from ``heartbeat_interval`` and the job's size."""

    heartbeat_interval: float
    max_nodes: int

    @property
    def heartbeat_every(self) -> float:
        """``heartbeat_interval``, or slower in a job so large that all heartbeats together would pass
        :data:`HEARTBEATS_PER_SECOND` (the store serves every participant; at 0.1 s, 4,096
        participants alone sent 41,000 beats/s). 1,024 participants: 0.41 s."""
        return max(self.heartbeat_interval, self.max_nodes / HEARTBEATS_PER_SECOND)

    @property
    def dead_after(self) -> float:
        """Heartbeat silence after which a participant whose process is proven gone counts as dead:
        four beats."""
        return 4 * self.heartbeat_every

    @property
    def unproven_dead_after(self) -> float:
        """Heartbeat silence after which a participant not proven gone counts as dead."""
        return max(self.dead_after, UNPROVEN_DEAD_FLOOR)

    @property
    def takeover_after(self) -> float:
        return max(self.dead_after, TAKEOVER_FLOOR)

    @property
    def frozen_peer_after(self) -> float:
        return max(5 * self.dead_after, FROZEN_PEER_FLOOR)

    @property
    def all_silent_after(self) -> float:
        return max(self.dead_after, ALL_SILENT_FLOOR)


def came_back(record: LostRecord, beat_now: int | None) -> bool:
    """Whether a participant recorded lost for good is back: one judged dead by its silent
    heartbeat whose heartbeat rose past the number it stood still at (it was frozen, not dead;
    thawed, it waits as a spare and can take part). One that left for good itself never is."""
    return record.silent_at is not None and beat_now is not None and beat_now > record.silent_at


class HeartbeatTracker:
    """The highest heartbeat seen per participant, and since when it stood still."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, tuple[int | None, float]] = {}

    def knows(self, who: Hashable) -> bool:
        """Whether ``who`` was observed before (a first observation never counts as silence)."""
        return who in self._seen

    def observe(self, who: Hashable, beat: int | None, now: float) -> float:
        """Record ``beat`` (the authentic number read at ``now``; None: absent or not authentic).
        Returns how long the heartbeat has stood still: 0.0 when it rose now or is first seen."""
        previous = self._seen.get(who)
        if previous is None or (beat is not None and (previous[0] is None or beat > previous[0])):
            self._seen[who] = (beat, now)
            return 0.0
        return now - previous[1]

    def last_beat(self, who: Hashable) -> int | None:
        """The highest heartbeat number seen of ``who`` (None: none yet)."""
        seen = self._seen.get(who)
        return seen[0] if seen is not None else None

    def silent(self, beats: Mapping[Hashable, int | None], now: float, after: float) -> set[Hashable]:
        """Observe every beat of ``beats``; returns those that stood still for ``after`` seconds or more."""
        return {who for who, beat in beats.items() if self.observe(who, beat, now) >= after}

    def clear(self) -> None:
        self._seen.clear()

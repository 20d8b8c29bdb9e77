"""Who is alive, judged by sealed heartbeats: the one liveness rule of the package.

A participant's heartbeat thread raises a sealed number every heartbeat interval. A reader counts
a beat only when the number *rises* above the highest it saw: a replayed older value, or one that
fails its check, is silence (a store client without the job secret cannot keep a dead peer
alive). The rendezvous coordinator (previous actives that did not come back), the round
watchdog (a frozen peer) and a hot spare (every active silent) all ask this tracker, each with
its own threshold derived from the heartbeat interval (see ``RendezvousSettings.dead_after``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping


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

    def silent(self, beats: Mapping[Hashable, int | None], now: float, after: float) -> set[Hashable]:
        """Observe every beat of ``beats``; returns those that stood still for ``after`` seconds or more."""
        return {who for who, beat in beats.items() if self.observe(who, beat, now) >= after}

    def clear(self) -> None:
        self._seen.clear()

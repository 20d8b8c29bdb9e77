"""Names of the store keys one rendezvous run uses.

Round-scoped keys carry the round number (``r{N}/...``). Slot keys are shared by all rounds
and never cleared; the ``cycle_id`` inside each slot tells readers which round wrote it.
"""

from __future__ import annotations

from functools import lru_cache

# torch's elastic agent writes this key under the store a rendezvous returns once every
# agent of the group passed its exit barrier. Derived from torch so that a rename fails
# loudly at import instead of silently leaving standby nodes waiting forever.
try:
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN
except ImportError as exc:  # pragma: no cover - depends on the torch version
    raise ImportError(
        "lightning_ft needs torch's elastic exit-barrier key names "
        "(_TERMINAL_STATE_SYNC_ID, _LAST_MEMBER_CHECKIN); this torch version renamed them") from exc

EXIT_BARRIER_KEY = _TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN


class StoreKeys:
    """Key layout under ``lightning_ft/<run_id>/``."""

    def __init__(self, run_id: str) -> None:
        self.prefix = f"lightning_ft/{run_id}"
        p = self.prefix
        self.cycle = f"{p}/cycle"
        self.closed_for_good = f"{p}/closed_for_good"
        self.lost_count = f"{p}/lost_count"
        self.unhealthy_count = f"{p}/unhealthy_count"
        self.last_actives = f"{p}/last_actives"
        self.shutdown_acks = f"{p}/shutdown_acks"

    def round_key(self, cycle_id: int, name: str) -> str:
        return f"{self.prefix}/r{cycle_id}/{name}"

    def arrived(self, cycle_id: int) -> str:
        return self.round_key(cycle_id, "arrived")

    def written(self, cycle_id: int) -> str:
        return self.round_key(cycle_id, "written")

    def withdrawn(self, cycle_id: int) -> str:
        return self.round_key(cycle_id, "withdrawn")

    def closed(self, cycle_id: int) -> str:
        return self.round_key(cycle_id, "closed")

    def ready(self, cycle_id: int) -> str:
        return self.round_key(cycle_id, "ready")

    def coordinator(self, cycle_id: int) -> str:
        return self.round_key(cycle_id, "coordinator")

    def coordinator_beat(self, cycle_id: int) -> str:
        return self.round_key(cycle_id, "coordinator_beat")

    def round_store_prefix(self, cycle_id: int) -> str:
        """Prefix of the store handed to the training job of this round."""
        return self.round_key(cycle_id, "job")

    def exit_barrier(self, cycle_id: int) -> str:
        return f"{self.round_store_prefix(cycle_id)}/{EXIT_BARRIER_KEY}"

    def slot(self, index: int) -> str:
        return f"{self.prefix}/slot/{index}"

    def slot_rank(self, index: int) -> str:
        return f"{self.prefix}/slot/{index}/rank"

    def heartbeat(self, participant_id: str) -> str:
        return f"{self.prefix}/heartbeat/{participant_id}"

    def lost_marker(self, participant_id: str) -> str:
        return f"{self.prefix}/lost/{participant_id}"

    def slot_keys(self, count: int) -> list[str]:
        return _slot_keys(self.prefix, count)


@lru_cache(maxsize=8)
def _slot_keys_cached(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}/slot/{i}" for i in range(count))


def _slot_keys(prefix: str, count: int) -> list[str]:
    return list(_slot_keys_cached(prefix, count))

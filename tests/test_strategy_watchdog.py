"""RoundWatchdog against a real TCPStore: progress publication and blame for a hung step."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from lightning_ft.rendezvous.liveness import LivenessThresholds
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.runtime.watchdog import RoundWatchdog, StepClock
from lightning_ft.schema.round import decode_progress, encode_member, member_key, progress_key
from lightning_ft.schema.run import RunKeys
from lightning_ft.schema.signing import SealedStore, Signer

pytestmark = pytest.mark.timeout(150)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    yield server


def watchdog(store, rank: int, clock: StepClock, triggered: list, hang_floor: float = 2.0) -> RoundWatchdog:
    values = SealedStore(store, Signer(None), "round")
    values.put(member_key(rank), encode_member(f"p{rank}", f"d{rank}"))
    return RoundWatchdog(
        round_values=values, records=RunRecords(store, Signer(None), RunKeys("watched")), round_id=0, rank=rank,
        world_size=2, clock=clock,
        hang_detection=True, hang_floor=hang_floor, hang_factor=10.0, liveness=LivenessThresholds(0.1, 2),
        on_trigger=lambda *args: triggered.append(args), break_group=lambda: 0, progress_interval=0.3)


def published(store, rank: int) -> int | None:
    key = f"round/{progress_key(rank)}"
    return decode_progress(store.get(key)).completed if store.check([key]) else None


def test_progress_is_published_at_most_once_per_progress_interval(store):
    clock = StepClock()
    dog = watchdog(store, 0, clock, [])
    clock.finished(time.monotonic())
    dog._poll()
    assert published(store, 0) == 1
    clock.finished(time.monotonic())
    dog._poll()  # within the interval: the store is not asked
    assert published(store, 0) == 1
    time.sleep(0.35)
    dog._poll()
    assert published(store, 0) == 2
    dog._poll()  # unchanged: nothing to publish
    assert published(store, 0) == 2


def test_progress_interval_stays_well_below_the_hang_floor(store):
    dog = watchdog(store, 0, StepClock(), [], hang_floor=0.8)
    assert dog.progress_interval == pytest.approx(0.2)


def test_overdue_step_is_blamed_on_the_peer_that_completed_fewer_steps(store):
    behind, ahead = StepClock(), StepClock()
    triggered: list = []
    dog_behind, dog_ahead = watchdog(store, 0, behind, []), watchdog(store, 1, ahead, triggered)
    now = time.monotonic()
    for clock, steps in ((behind, 3), (ahead, 4)):
        for _ in range(steps):
            clock.started(now - 0.01)
            clock.finished(now)
    dog_behind._poll()
    dog_ahead._poll()
    SealedStore(store, Signer(None)).put(RunKeys("watched").heartbeat("p0"), "1")
    ahead.started(time.monotonic() - 30.0)  # in the all-reduce of step 5 for 30 s
    assert dog_ahead._poll() is True
    detector, reason, stalled = triggered[0]
    assert detector.value == "hang" and stalled == (0,) and "completed fewer steps" in reason

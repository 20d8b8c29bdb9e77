"""The spare's monitor opens a round only when every active is silent and the run goes on."""

import datetime
import time

import pytest
import torch.distributed as dist

from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.runtime.spare_monitor import SpareMonitor
from lightning_ft.schema.round import encode_member, member_key
from lightning_ft.schema.run import CloseKind, CloseReason, RunKeys, encode_number
from lightning_ft.schema.signing import SealedStore, Signer


def monitor_of_silent_actives(closed: bool) -> list:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    keys, signer = RunKeys("spare-mon"), Signer(None)
    values = SealedStore(store, signer)
    RunRecords(store, signer, keys).current_round()  # round 0
    values.put(keys.ready(0), "decided")  # it trains
    round_values = SealedStore(store, signer, keys.round_store_prefix(0))
    for rank, pid in enumerate(("a", "b")):
        round_values.put(member_key(rank), encode_member(pid, "d"))
        values.put(keys.heartbeat(pid), encode_number(1))  # beat once, then silent
    if closed:  # what the last active stopped by SIGTERM writes before it exits
        values.put(values.unlisted(keys.closed_for_good), CloseReason(CloseKind.STOPPED, "SIGTERM").encode())
    opened: list = []
    monitor = SpareMonitor(rdzv_store=store, keys=keys, signer=signer, dead_after=0.1,
                           open_round=lambda r, why: opened.append((r, why)))
    for _ in range(4):
        monitor._poll()
        time.sleep(0.06)
    return opened


@pytest.mark.parametrize("closed", [False, True], ids=["run goes on", "closed for good"])
def test_silent_actives_open_a_round_only_while_the_run_goes_on(closed):
    opened = monitor_of_silent_actives(closed)
    assert (opened == []) if closed else (opened and opened[0][0] == 0), opened

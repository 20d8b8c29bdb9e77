"""The durable tier in one process: upload, markers, manifests, torn and partial steps, retention,
download into the snapshot root, bad configuration."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import zlib

import pytest
import torch

from lightning_ft.checkpoint.durable.persister import DurablePersister
from lightning_ft.checkpoint.durable.settings import resolve_durable_settings
from lightning_ft.checkpoint.durable.targets import FileRanges, LocalDirTarget, open_target
from lightning_ft.checkpoint.durable.tier import DurableTier, UploadCancelled
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.store import SnapshotStore


def state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((64,), value)}, "global_step": int(value)}


@pytest.fixture
def stores(tmp_path):
    made = [SnapshotStore(tmp_path / "shm", run_id="job", rank=r, keep_last=2) for r in (0, 1)]
    yield made
    for s in made:
        s.close()


def tier_at(tmp_path, keep_last=2) -> DurableTier:
    return DurableTier(LocalDirTarget(str(tmp_path / "durable")), "job", keep_last=keep_last)


def test_a_step_is_published_only_when_every_rank_uploaded(tmp_path, stores):
    tier = tier_at(tmp_path)
    infos = [s.save(state(10.0), 10) for s in stores]
    first = tier.upload(infos[0], "seg", world_size=2)
    assert not first.complete and tier.complete_steps() == []  # rank 1's shard is missing
    second = tier.upload(infos[1], "seg", world_size=2)
    assert second.complete and tier.complete_steps() == [10]
    manifest = json.loads((tmp_path / "durable/job/manifests/step-000000000010.json").read_text())
    assert [s["rank"] for s in manifest["shards"]] == [0, 1] and manifest["segment"] == "seg"
    # on storage the timeline keeps its earlier name; a marker names its run and model (no secret: plain JSON)
    marker = json.loads((tmp_path / "durable/job/steps/step-000000000010/seg/rank1.done.json").read_text())
    model = stores[1].identity(infos[1]).model
    assert marker == {"step": 10, "segment": "seg", "rank": 1, "world_size": 2, "nbytes": infos[1].nbytes,
                      "checksum": marker["checksum"], "run_id": "job", "model": model}
    assert manifest["run_id"] == "job" and manifest["model"] == model and len(model) == 16


def test_a_shard_without_its_marker_or_a_torn_upload_is_never_a_step(tmp_path, stores):
    tier = tier_at(tmp_path)
    info0, info1 = (s.save(state(10.0), 10) for s in stores)
    tier.upload(info0, "seg", world_size=2)
    # rank 1 killed after its shard but before its marker; and a torn temp file of a kill mid-write
    timeline_dir = tmp_path / "durable/job/steps/step-000000000010/seg"
    (timeline_dir / "rank1.snap").write_bytes(open(info1.path, "rb").read())
    (timeline_dir / ".tmp-rank1.snap-999-abcd").write_bytes(b"partial")
    assert tier.complete_steps() == []
    assert not tier.publish_if_complete(10, "seg")
    # a marker of another timeline never completes it either
    other = tier.upload(info1, "other", world_size=2)
    assert not other.complete and tier.complete_steps() == []


def test_a_cancelled_upload_leaves_no_marker(tmp_path, stores):
    tier = tier_at(tmp_path)
    info = stores[0].save(state(1.0), 1)
    with pytest.raises(UploadCancelled):
        tier.upload(info, "seg", world_size=1, deadline=0.0)
    assert tier.markers(1, "seg") == [] and tier.complete_steps() == []


def test_retention_keeps_the_newest_complete_steps(tmp_path, stores):
    tier = tier_at(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        for s in stores:
            tier.upload(s.save(state(float(step)), step), "seg", world_size=2)
    assert tier.complete_steps() == [20, 30]
    assert sorted(os.listdir(tmp_path / "durable/job/steps")) == ["step-000000000020", "step-000000000030"]


def test_fetch_downloads_into_an_empty_snapshot_root_and_loads_verified(tmp_path, stores):
    tier = tier_at(tmp_path)
    for s in stores:
        tier.upload(s.save(state(7.0), 7), "seg", world_size=2)
    # the manifest names each shard's snapshot header CRC-32 (an independent computation here),
    # which differs between ranks (their identities differ)
    manifest = json.loads((tmp_path / "durable/job/manifests/step-000000000007.json").read_text())
    shard_bytes = (tmp_path / "durable/job/steps/step-000000000007/seg/rank1.snap").read_bytes()
    assert manifest["shards"][0]["checksum"] != manifest["shards"][1]["checksum"]
    header_crc = zlib.crc32(shard_bytes[:fmt.HEADER_FIELDS_SIZE])
    assert manifest["shards"][1] == {"rank": 1, "nbytes": len(shard_bytes),
                                     "checksum": f"snapshot-crc32:{header_crc:08x}"}
    fresh = SnapshotStore(tmp_path / "new-node-shm", run_id="job", rank=1)
    info = tier.fetch_into(7, 1, fresh)
    loaded = fresh.load(info, expect=fresh.expected_identity())
    assert torch.equal(loaded["state_dict"]["w"], torch.full((64,), 7.0))
    # a rank the writing job did not have takes rank 0's shard
    extra = SnapshotStore(tmp_path / "third-shm", run_id="job", rank=2)
    assert extra.load(tier.fetch_into(7, 2, extra))["global_step"] == 7
    # a shard that changed after its manifest was written is refused
    shard = tmp_path / "durable/job/steps/step-000000000007/seg/rank1.snap"
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 0xFF
    shard.write_bytes(bytes(blob))
    with pytest.raises(Exception, match="does not match its manifest: data checksum mismatch"):
        tier.fetch_into(7, 1, SnapshotStore(tmp_path / "other-shm", run_id="job", rank=1))
    # so is another snapshot of the same step in its place (a rerun's): its header differs
    other = SnapshotStore(tmp_path / "rerun-shm", run_id="job", rank=1)
    shutil.copyfile(other.save(state(7.0), 7).path, shard)
    with pytest.raises(Exception, match="does not match its manifest: size or header checksum"):
        tier.fetch_into(7, 1, SnapshotStore(tmp_path / "other-shm2", run_id="job", rank=1))
    other.close()


class _DamagingDirTarget(LocalDirTarget):
    """A directory that stores one flipped byte in every shard and says it reads uploads back
    (what an object store target does): the read back must catch it before a marker exists."""

    read_back_verifies = True

    def write(self, path, chunks):
        if not path.endswith(".snap"):
            return super().write(path, chunks)
        blob = bytearray(b"".join(bytes(c) for c in chunks))
        blob[len(blob) // 2] ^= 0x01
        return super().write(path, [bytes(blob)])


def test_a_shard_damaged_on_its_way_is_caught_by_the_read_back_and_never_marked(tmp_path, stores):
    tier = DurableTier(_DamagingDirTarget(str(tmp_path / "durable")), "job")
    info = stores[0].save({"state_dict": {"w": torch.randn(3 << 18)}, "global_step": 5}, 5)
    with pytest.raises(OSError, match="damaged when read back after the upload: data checksum mismatch in block"):
        tier.upload(info, "seg", world_size=1)
    assert tier.markers(5, "seg") == [] and tier.complete_steps() == []
    # the same upload undamaged passes the read back
    clean = DurableTier(LocalDirTarget(str(tmp_path / "durable2")), "job")
    clean.target.read_back_verifies = True
    assert clean.upload(info, "seg", world_size=1).complete


def test_the_persister_uploads_the_newest_offer_and_holds_the_file(tmp_path, stores):
    store = stores[0]
    tier = tier_at(tmp_path)
    gate, started = threading.Event(), threading.Event()
    real_upload = tier.upload

    def slow_upload(info, *a, **k):
        started.set()
        gate.wait(10)
        return real_upload(info, *a, **k)

    tier.upload = slow_upload
    persister = DurablePersister(tier, lambda: store, rank=0)
    assert persister.offer(store.save(state(1.0), 1), "seg", 1) == "start"
    assert started.wait(10)
    for step in (2, 3, 4):
        info = store.save(state(float(step)), step)
        assert 1 in store.held_steps()  # the running upload's file is never recycled
        persister.offer(info, "seg", 1)
    gate.set()
    assert persister.wait_idle(20)
    # steps 2 and 3 were superseded by 4 while 1 was uploading
    assert tier.complete_steps() == [1, 4] and persister.skipped == 2
    assert store.held_steps() == set()


def test_settings_come_from_the_environment_and_bad_ones_are_clear(tmp_path):
    env = {"LIGHTNING_FT_PERSIST_TO": str(tmp_path), "LIGHTNING_FT_PERSIST_EVERY_SECONDS": "5",
           "LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND": "0"}
    settings = resolve_durable_settings(environ=env)
    assert (settings.url, settings.every_n_seconds, settings.max_bytes_per_second) == (str(tmp_path), 5.0, None)
    assert resolve_durable_settings(environ={}) is None
    with pytest.raises(ValueError, match="LIGHTNING_FT_PERSIST_EVERY_SECONDS"):
        resolve_durable_settings(environ={**env, "LIGHTNING_FT_PERSIST_EVERY_SECONDS": "soon"})
    with pytest.raises(ValueError, match="persist_keep_last"):
        resolve_durable_settings(str(tmp_path), keep_last=0, environ={})
    with pytest.raises(ValueError, match="nosuchscheme"):
        open_target("nosuchscheme://bucket/x")
    # pacing: on by default (2 %), off with 0 or without a bound, bad values named
    assert settings.pacer() is None  # unbounded: nothing to pace
    paced = resolve_durable_settings(str(tmp_path), environ={})
    assert paced.max_overhead == 0.02 and paced.pacer().ceiling == 512 * 2**20
    assert resolve_durable_settings(str(tmp_path), environ={"LIGHTNING_FT_PERSIST_MAX_OVERHEAD": "0"}).pacer() is None
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ValueError, match="persist_max_overhead"):
            resolve_durable_settings(str(tmp_path), environ={"LIGHTNING_FT_PERSIST_MAX_OVERHEAD": bad})


def test_the_persister_paces_by_steps_an_upload_ran_through_and_leaves_out_the_rest(tmp_path, stores):
    """A real upload on the persister's thread, held at 64 KiB/s so it runs through the steps below;
    the step durations are given, so the verdict is known."""
    from lightning_ft.checkpoint.pacing import UploadPacer

    store = stores[0]
    tier = tier_at(tmp_path)
    events = []
    pacer = UploadPacer(ceiling=64 << 10, budget=0.02, floor=16 << 10, min_steps=4)  # 10 % slower below: clear
    persister = DurablePersister(tier, lambda: store, rank=0, emit=lambda e, **f: events.append((e, f)), pacer=pacer)
    assert tier.max_bytes_per_second == 64 << 10  # the pacer's start, capped by the bound
    for _ in range(4):
        persister.observe_step(1.0, persister.activity())  # idle steps
    before = persister.activity()
    persister.offer(store.save({"state_dict": {"w": torch.randn(1 << 20)}, "global_step": 1}, 1), "seg", 1)
    import time

    deadline = time.monotonic() + 30
    while not persister.activity()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    persister.observe_step(5.0, before)  # the upload started inside this step: left out
    for _ in range(4):
        persister.observe_step(1.1, persister.activity())
    assert [e for e, _ in events] == ["durable_pacing"]
    fields = events[0][1]
    assert fields["slowdown"] == pytest.approx(0.1) and (fields["busy_steps"], fields["idle_steps"]) == (4, 4)
    assert tier.max_bytes_per_second == 16 << 10 and fields["mib_per_second"] == round((16 << 10) / 2**20, 1)
    tier.max_bytes_per_second = None  # let the 4 MiB upload finish quickly
    assert persister.wait_idle(60)


# ---------------------------------------------------------------------- inside a real Trainer


def _fit(max_steps, callbacks, ckpt_path=None, plugins=None):
    import lightning.pytorch as pl

    from ckpt_helpers import make_module, trainer_kwargs

    trainer = pl.Trainer(**trainer_kwargs(max_steps=max_steps, callbacks=callbacks, plugins=plugins or []))
    trainer.fit(make_module(0), ckpt_path=ckpt_path)
    return trainer


def test_auto_resume_and_mem_latest_take_a_durable_step_when_memory_is_empty(tmp_path, caplog, monkeypatch):
    from lightning_ft import EmergencyCheckpoint
    from lightning_ft.checkpoint import MemoryCheckpointIO
    from lightning_ft.events import read_events

    from ckpt_helpers import resume_probe

    monkeypatch.setenv("LIGHTNING_FT_EVENTS_DIR", str(tmp_path / "events"))
    durable = str(tmp_path / "durable")
    first = EmergencyCheckpoint(every_n_steps=5, root=str(tmp_path / "shm1"), run_id="t", persist_to=durable,
                                persist_every_n_seconds=0)
    _fit(12, [first])
    assert first.persister.wait_idle(20)
    assert first.durable.complete_steps() == [5, 10]
    uploads = [e for e in read_events(tmp_path / "events") if e["event"] == "durable_upload"]
    assert [(e["step"], e["complete"]) for e in uploads] == [(5, True), (10, True)] and uploads[0]["bytes"] > 0

    # a new node: an empty snapshot root, the durable tier from the environment
    probe = resume_probe()
    with caplog.at_level(logging.INFO, logger="lightning_ft"):
        trainer = _fit(13, [EmergencyCheckpoint(root=str(tmp_path / "shm2"), run_id="t", persist_to=durable), probe])
    assert probe.start_step == 10 and trainer.global_step == 13
    assert "resume step 10 from the durable tier" in caplog.text

    probe = resume_probe()
    io = MemoryCheckpointIO(root=str(tmp_path / "shm3"), run_id="t", persist_to=durable)
    trainer = _fit(11, [probe], ckpt_path="mem://latest", plugins=[io])
    assert probe.start_step == 10 and trainer.global_step == 11


def test_in_a_trainer_steps_during_uploads_pace_the_bound_and_say_so(tmp_path, monkeypatch):
    """~2 MiB of state copied at 1 MiB/s from step 30, held until 24 steps ran during it. A step
    that starts while a copy runs takes 100 ms instead of 5 on the clock the callback times steps
    with, so the pacer must see the slowdown during that copy and lower the bound. The pacer's
    floor is lowered to 128 KiB/s for this small state.

    The step times are the test's, not the machine's: with sleeps on the real clock, a loaded
    machine (load 9-13 on 2 cores) made this Trainer's steps take 0.04-3.8 s at random, and the
    100 ms went unseen in 2 runs of 8 (or 120 steps outlasted the test's timeout). Everything
    else is real: Lightning's hooks, the upload thread and what it says it is doing when each
    step starts and ends, the pacer, the event and the bound the tier then copies with."""
    import lightning.pytorch as pl

    from lightning_ft import EmergencyCheckpoint
    from lightning_ft.checkpoint.durable.persister import DurablePersister
    from lightning_ft.checkpoint.durable.settings import DurableSettings
    from lightning_ft.checkpoint.lightning.calibration import ScheduleCalibration
    from lightning_ft.checkpoint.pacing import UploadPacer
    from lightning_ft.events import read_events

    from ckpt_helpers import make_module, trainer_kwargs

    # the copy is held until 24 steps ran during it, however slow the machine makes each step,
    # and the step after the offer waits for the copy to run, however late its thread starts
    offered, uploading, gate = threading.Event(), threading.Event(), threading.Event()

    class StepTimes(pl.Callback):
        """The clock the checkpoint callback times steps with; each step moves it on as it starts."""

        now = 0.0
        busy_steps = 0

        def on_train_batch_start(self, *args):
            if offered.is_set():
                assert uploading.wait(60)
            if callback.persister.activity()[0]:
                self.busy_steps += 1
                if self.busy_steps >= 24:
                    gate.set()
                self.now += 0.1
            else:
                self.now += 0.005

    steps = StepTimes()
    monkeypatch.setattr(ScheduleCalibration, "clock", staticmethod(lambda: steps.now))
    monkeypatch.setattr(DurableSettings, "pacer", lambda self: UploadPacer(self.max_bytes_per_second, self.max_overhead,
                                                                          floor=128 << 10, start=1 << 20))
    monkeypatch.setenv("LIGHTNING_FT_EVENTS_DIR", str(tmp_path / "events"))
    callback = EmergencyCheckpoint(every_n_steps=30, root=str(tmp_path / "shm"), run_id="t",
                                   persist_to=str(tmp_path / "durable"), persist_every_n_seconds=0,
                                   persist_max_mib_per_second=1)
    real_upload = callback.durable.upload

    def held_upload(*args, **kwargs):
        uploading.set()
        assert gate.wait(120)
        return real_upload(*args, **kwargs)

    callback.durable.upload = held_upload
    real_offer = DurablePersister.offer

    def offer(self, *args, **kwargs):
        offered.set()
        return real_offer(self, *args, **kwargs)

    monkeypatch.setattr(DurablePersister, "offer", offer)  # the persister is made at setup
    module = make_module(0, hidden=16384)
    # one epoch of 150 batches: no epoch ends (dataloader restarts) among the steps compared
    data = torch.utils.data.TensorDataset(torch.randn(600, 8), torch.randn(600, 1))
    module.train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=4)
    # the one snapshot is step 30's: the next would be due at step 60
    trainer = pl.Trainer(**trainer_kwargs(max_steps=59, callbacks=[callback, steps]))
    # one intra-op thread: with two on a loaded 2-core machine every small op waits for the
    # other thread to be scheduled (a step of this model: 0.01 s median, 0.2-1.1 s at the 90th
    # percentile beside busy loops), and the 59 steps would take minutes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.fit(module)
    finally:
        torch.set_num_threads(threads)
        gate.set()
    pacing = [e for e in read_events(tmp_path / "events") if e["event"] == "durable_pacing"]
    paced = callback.durable.max_bytes_per_second
    callback.durable.max_bytes_per_second = None  # let the copy finish now
    assert callback.persister.wait_idle(60)
    assert callback.durable.complete_steps() == [30]
    assert steps.busy_steps >= 24
    assert pacing, "the steps during the upload were not seen as slower"
    first = pacing[0]
    # the first 8 steps the copy ran through (held: it ran through 24), against the idle ones before it
    assert first["busy_steps"] == 8 and first["idle_steps"] >= 25 and first["slowdown"] == 19.0
    assert first["mib_per_second_before"] == 1.0 and 0.125 <= first["mib_per_second"] < 1.0
    assert abs(paced / 2**20 - pacing[-1]["mib_per_second"]) < 0.1


def test_the_durable_tier_is_off_without_a_run_id(tmp_path, monkeypatch, caplog):
    from lightning_ft import EmergencyCheckpoint

    for key in ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    with caplog.at_level(logging.WARNING):
        callback = EmergencyCheckpoint(root=str(tmp_path / "shm"), persist_to=str(tmp_path / "durable"))
    assert callback.durable is None and "persist_to" in caplog.text


def test_a_too_small_shm_is_reported_before_the_first_save_with_the_fix(tmp_path, small_tmpfs, caplog):
    import lightning.pytorch as pl

    from lightning_ft import EmergencyCheckpoint

    from ckpt_helpers import make_module, trainer_kwargs

    tiny = small_tmpfs("shm", "64k")  # a container's /dev/shm, scaled down
    callback = EmergencyCheckpoint(every_n_steps=2, root=str(tiny), run_id="t")
    with caplog.at_level(logging.ERROR, logger="lightning_ft"):
        trainer = pl.Trainer(**trainer_kwargs(max_steps=3, callbacks=[callback]))
        trainer.fit(make_module(0, hidden=512))
    first_error = next(r for r in caplog.records if r.levelno >= logging.ERROR)
    assert "LIGHTNING_FT_SNAPSHOT_DIR" in first_error.getMessage() and "MiB missing" in first_error.getMessage()
    # reported before the first save was tried (that save then fails and is logged after it)
    assert "periodic snapshot" not in first_error.getMessage()
    assert trainer.global_step == 3  # training goes on


def test_enough_room_is_not_reported(tmp_path, caplog):
    from lightning_ft import EmergencyCheckpoint

    with caplog.at_level(logging.ERROR, logger="lightning_ft"):
        _fit(3, [EmergencyCheckpoint(every_n_steps=2, root=str(tmp_path / "shm"), run_id="t")])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_over_s3_with_storage_options_a_cancelled_upload_leaves_no_object(tmp_path, stores, s3_server):
    import uuid

    options = {"endpoint_url": s3_server["AWS_ENDPOINT_URL"], "key": "testing", "secret": "testing"}
    target = open_target(f"s3://lightning-ft-test/unit-{uuid.uuid4().hex[:8]}", options)
    tier = DurableTier(target, "job")
    import time

    # 4 MiB at 8 MiB/s in 1 MiB chunks: the deadline passes after a few chunks were written
    big = stores[0].save({"state_dict": {"w": torch.zeros(1 << 20)}, "global_step": 2}, 2)
    tier.max_bytes_per_second = 8 << 20
    with pytest.raises(UploadCancelled):
        tier.upload(big, "seg", world_size=2, deadline=time.monotonic() + 0.2)
    tier.max_bytes_per_second = None
    assert target.size(tier.shard_path(2, "seg", 0)) is None and tier.markers(2, "seg") == []
    infos = [s.save(state(3.0), 3) for s in stores]
    for info in infos:
        tier.upload(info, "seg", world_size=2)
    assert tier.complete_steps() == [3]
    fresh = SnapshotStore(tmp_path / "new-shm", run_id="job", rank=0)
    assert fresh.load(tier.fetch_into(3, 0, fresh))["global_step"] == 3


def test_flush_waits_for_the_running_upload_then_copies_the_newest_or_reports_it_did_not(tmp_path, stores):
    import time

    store = stores[0]
    tier = tier_at(tmp_path)
    persister = DurablePersister(tier, lambda: store, rank=0)
    # step 1's upload runs until the flush started (so step 2's offer is queued, whatever the load)
    gate, started = threading.Event(), threading.Event()
    real_upload = tier.upload

    def first_upload_held(info, *a, **k):
        if info.step == 1:
            started.set()
            assert gate.wait(20)
        return real_upload(info, *a, **k)

    tier.upload = first_upload_held
    persister.offer(store.save(state(1.0), 1), "seg", 1)
    assert started.wait(20)
    queued = store.save(state(2.0), 2)
    persister.offer(queued, "seg", 1)
    newest = store.save(state(3.0), 3)
    threading.Timer(0.3, gate.set).start()  # the flush below waits for the running upload
    result = persister.flush(newest, "seg", 1, deadline=time.monotonic() + 20)
    assert result is not None and result.complete and persister.last_durable_step == 3
    assert 3 in tier.complete_steps() and 2 not in tier.complete_steps()  # the queued offer was dropped
    assert store.held_steps() == set()
    # no time left: not durable, and said so
    assert persister.flush(store.save(state(4.0), 4), "seg", 1, deadline=time.monotonic() - 1) is None
    assert 4 not in tier.complete_steps() and store.held_steps() == set()


def test_a_flush_lifts_the_bandwidth_bound_of_the_running_upload_and_its_own(tmp_path, stores):
    """At the bound below, each 8 MiB shard needs 128 s: the flush and the upload it waits for end
    well inside the 60 s deadline only because the bound no longer applies to them."""
    import time

    store = stores[0]
    tier = tier_at(tmp_path)
    tier.max_bytes_per_second = 64 << 10
    big = {"state_dict": {"w": torch.randn(2 << 20)}, "global_step": 1}
    persister = DurablePersister(tier, lambda: store, rank=0)
    paced = []
    real_upload = tier.upload

    def recorded(*a, **k):
        result = real_upload(*a, **k)
        paced.append(result)
        return result

    tier.upload = recorded
    assert persister.offer(store.save(big, 1), "seg", 1) == "start"
    deadline = time.monotonic() + 60
    while persister._busy is None and time.monotonic() < deadline:  # the upload is in flight
        time.sleep(0.01)
    result = persister.flush(store.save(dict(big, global_step=2), 2), "seg", 1, deadline=deadline)
    assert result is not None and result.complete and result.paced_seconds == 0
    assert [r.step for r in paced] == [1, 2] and tier.complete_steps() == [1, 2]
    assert persister.measured_unbounded_bytes_per_second >= persister.measured_bytes_per_second
    # back to the bound afterwards: a periodic upload is paced again
    persister.offer(store.save(state(3.0), 3), "seg", 1)
    assert persister._rate() == 64 << 10
    assert persister.wait_idle(60)


def test_a_bounded_upload_reports_its_paced_time_and_its_unbounded_rate(tmp_path, stores):
    tier = tier_at(tmp_path)
    info = stores[0].save({"state_dict": {"w": torch.randn(256 << 10)}, "global_step": 1}, 1)  # 1 MiB
    tier.max_bytes_per_second = 512 << 10  # 16 ranges of 64 KiB, 1/8 s each
    bounded = tier.upload(info, "a", 1)
    assert bounded.paced_seconds > 0 and bounded.unbounded_bytes_per_second > bounded.nbytes / bounded.seconds
    tier.max_bytes_per_second = None
    assert tier.upload(info, "b", 1).paced_seconds == 0


def test_after_a_resume_from_an_older_step_the_manifests_of_newer_steps_of_other_timelines_go(tmp_path, stores):
    tier = tier_at(tmp_path, keep_last=5)
    for step, timeline in ((10, "a"), (20, "a"), (30, "b"), (40, "c")):
        tier.upload(stores[0].save(state(float(step)), step), timeline, world_size=1)
    assert tier.drop_abandoned(15, "c") == [20, 30]
    assert tier.complete_steps() == [10, 40]


def test_rank_0_drops_abandoned_manifests_only_after_every_rank_listed_the_durable_steps(tmp_path, stores):
    from lightning_ft.checkpoint.lightning.durable_copies import DurableCopies

    copies = DurableCopies(resolve_durable_settings(str(tmp_path / "durable"), environ={}), "job")
    copies.new_timeline()  # not distributed: this process's own token
    for step, timeline in ((10, "a"), (20, "a")):
        copies.tier.upload(stores[0].save(state(float(step)), step), timeline, world_size=1)
    copies.drop_abandoned(15, rank=0, listed_everywhere=False)
    copies.drop_abandoned(15, rank=1, listed_everywhere=True)
    assert copies.tier.complete_steps() == [10, 20]
    copies.drop_abandoned(15, rank=0, listed_everywhere=True)
    assert copies.tier.complete_steps() == [10]


def test_an_unlistable_durable_storage_is_unknown_not_empty(tmp_path, monkeypatch):
    from lightning_ft.checkpoint.exchange.agreement import agree_across_tiers

    tier = tier_at(tmp_path)

    def broken(path):
        raise OSError("connection reset")

    monkeypatch.setattr(tier.target, "list", broken)
    assert tier.complete_steps(attempts=2) is None
    assert tier.drop_abandoned(0, "a", attempts=1) == []  # unknown: nothing is removed
    choice = agree_across_tiers([4], tier, rank=0)
    assert (choice.step, choice.tier) == (4, "memory")
    assert not choice.durable_listed_everywhere and "could not list" in choice.reason


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_held_file_is_never_overwritten_by_later_snapshots(tmp_path, keep_last):
    from lightning_ft.checkpoint.memory import format as fmt

    store = SnapshotStore(tmp_path / "shm", run_id="job", rank=0, keep_last=keep_last)
    first = store.save(state(1.0), 1)
    fd = os.open(first.path, os.O_RDONLY)  # what the uploader has open
    store.hold(1)
    try:
        for step in (2, 3, 4):  # keep_last=1 would turn the replaced file into the next write's spare
            store.save(state(float(step)), step)
        header = fmt.Header.unpack(os.pread(fd, fmt.HEADER_SIZE, 0))
        assert header.step == 1
        blob = os.pread(fd, header.file_size, 0)
        fmt.verify(blob, len(blob))  # still the intact snapshot of step 1
    finally:
        store.release(1)
        os.close(fd)
        store.close()


def test_a_failed_download_is_an_error_naming_the_rank(tmp_path, stores, monkeypatch):
    from lightning_ft.checkpoint.exchange.agreement import agree_across_tiers, resume_from_newest_intact

    tier = tier_at(tmp_path)
    tier.upload(stores[0].save(state(5.0), 5), "seg", world_size=1)
    fresh = SnapshotStore(tmp_path / "new-shm", run_id="job", rank=0)
    choice = agree_across_tiers([], tier, rank=0)
    assert (choice.step, choice.tier) == (5, "durable")

    def unreachable(*a, **k):
        raise OSError("connection refused")

    monkeypatch.setattr(tier, "fetch_into", unreachable)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] could not get step 5"):
        resume_from_newest_intact([], tier, fresh, rank=0)


def test_garbage_or_renamed_manifests_are_ignored(tmp_path, stores):
    tier = tier_at(tmp_path)
    for s in stores:
        tier.upload(s.save(state(10.0), 10), "seg", world_size=2)
    manifests = tmp_path / "durable/job/manifests"
    (manifests / "step-000000000099.json").write_text("{not json")
    shutil.copy(manifests / "step-000000000010.json", manifests / "step-000000000050.json")  # renamed
    # an earlier build's manifest (CRC-32 over the whole shard) is unreadable, not a step to fetch
    earlier = json.loads((manifests / "step-000000000010.json").read_text())
    earlier["step"] = 60
    for shard in earlier["shards"]:
        shard["checksum"] = "crc32:0badf00d"
    (manifests / "step-000000000060.json").write_text(json.dumps(earlier))
    assert tier.complete_steps() == [10]


class _Ranges(FileRanges):
    """A plain file as a FileRanges source (what _ShardSource is, without pacing)."""

    def __init__(self, path, chunk_bytes):
        import mmap

        self.fd = os.open(path, os.O_RDONLY)
        self.nbytes = os.fstat(self.fd).st_size
        self.chunk_bytes = chunk_bytes
        self._map = mmap.mmap(self.fd, self.nbytes, prot=mmap.PROT_READ)

    def ranges(self):
        for offset in range(0, self.nbytes, self.chunk_bytes):
            yield offset, min(self.chunk_bytes, self.nbytes - offset)

    def view(self, offset, length):
        return memoryview(self._map)[offset:offset + length]


def _direct_io_works(directory) -> bool:
    """Whether this filesystem takes one 4 KiB O_DIRECT write from a page-aligned buffer."""
    import mmap

    buf = mmap.mmap(-1, 4096)
    fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT)
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return os.pwrite(fd, buf, 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(directory / "probe")
        buf.close()


@pytest.mark.parametrize("nbytes", [100, 4096, 3 * 65536 + 8, 5 * 65536])
@pytest.mark.parametrize("refused_at", [None, "fcntl", "write", "off"])
def test_a_directory_copy_is_byte_exact_with_direct_io_or_without(tmp_path, monkeypatch, caplog, nbytes,
                                                                 refused_at):
    """Block-aligned ranges go with O_DIRECT (where the filesystem takes it), the tail and a
    filesystem that refuses it (EINVAL at fcntl, EOPNOTSUPP at the first write) through
    sendfile; the stored object is the same bytes either way."""
    from lightning_ft.checkpoint.durable import targets as durable_target

    direct_refused = refused_at is not None  # "off": LocalDirTarget(direct_io=False)
    if refused_at == "write":
        real_pwrite = os.pwrite

        def refuse_direct(fd, data, offset):
            if durable_target.fcntl.fcntl(fd, durable_target.fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(95, "Operation not supported")
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", refuse_direct)
    if refused_at == "fcntl":
        real_fcntl = durable_target.fcntl.fcntl

        def refuse(fd, cmd, arg=0):
            if cmd == durable_target.fcntl.F_SETFL and arg & os.O_DIRECT:
                raise OSError(22, "Invalid argument")
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(durable_target.fcntl, "fcntl", refuse)
    payload = os.urandom(nbytes)
    src = tmp_path / "src.bin"
    src.write_bytes(payload)
    target = LocalDirTarget(str(tmp_path / "durable"), direct_io=refused_at != "off")
    with caplog.at_level(logging.DEBUG, logger="lightning_ft.checkpoint.durable.targets"):
        assert target.write("run/a.snap", _Ranges(src, 65536)) == nbytes
    assert (tmp_path / "durable" / "run" / "a.snap").read_bytes() == payload
    assert os.listdir(tmp_path / "durable" / "run") == ["a.snap"]
    direct = 0 if direct_refused or not _direct_io_works(tmp_path) else nbytes - nbytes % durable_target.DIRECT_ALIGN
    assert f"copied {nbytes} bytes" in caplog.text and f"({direct} with direct I/O)" in caplog.text


def test_upload_ranges_are_whole_64_kib_blocks_at_any_bandwidth_bound():
    from lightning_ft.checkpoint.durable.tier import CHUNK_BYTES, range_bytes

    assert range_bytes(None) == CHUNK_BYTES == range_bytes(512 * 2**20)
    for rate in (1.0, 300_000.0, 10.5 * 2**20, 33.3 * 2**20):
        n = range_bytes(rate)
        assert n % 65536 == 0 and 65536 <= n <= max(65536, rate / 8)


def test_direct_io_is_the_default_only_on_a_local_block_filesystem(tmp_path):
    from lightning_ft.checkpoint.durable.targets import filesystem_type

    mountinfo = "\n".join([
        "22 1 252:1 / / rw,relatime - ext4 /dev/vda rw",
        "30 22 0:40 / /mnt/nfs rw,relatime - nfs4 server:/export rw,vers=4.2",
        "31 22 8:17 / /mnt/my\\040disk rw - xfs /dev/sdb1 rw",
        "32 22 0:41 / /dev/shm rw - tmpfs tmpfs rw",
        "garbage line",
    ])
    assert filesystem_type("/work/run", mountinfo) == "ext4"
    assert filesystem_type("/mnt/nfs/ckpt", mountinfo) == "nfs4"
    assert filesystem_type("/mnt/nfs", mountinfo) == "nfs4"
    assert filesystem_type("/mnt/nfsx/ckpt", mountinfo) == "ext4"  # a prefix of the name is not a parent
    assert filesystem_type("/mnt/my disk/ckpt", mountinfo) == "xfs"
    assert filesystem_type("relative", "") is None
    # real mounts: /dev/shm is tmpfs, where direct I/O saves nothing
    assert LocalDirTarget(str(tmp_path / "d"), direct_io=True).direct_io
    if os.path.isdir("/dev/shm"):
        shm_dir = f"/dev/shm/lightning_ft-test-{os.getpid()}"
        try:
            assert not LocalDirTarget(shm_dir).direct_io
        finally:
            shutil.rmtree(shm_dir, ignore_errors=True)


# ---------------------------------------------------------------------- a durable copy damaged after it was written


def _damage(shard) -> None:
    """Flip one byte of a shard's data region on disk (after its upload and manifest)."""
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 0xFF
    shard.write_bytes(bytes(blob))


def _fit_to_durable_steps(tmp_path, durable):
    from lightning_ft import EmergencyCheckpoint

    first = EmergencyCheckpoint(every_n_steps=5, root=str(tmp_path / "shm1"), run_id="t", persist_to=durable,
                                persist_every_n_seconds=0)
    _fit(12, [first])
    assert first.persister.wait_idle(20)
    assert first.durable.complete_steps() == [5, 10]
    return {step: next((tmp_path / f"durable/t/steps/step-{step:012d}").glob("*/rank0.snap")) for step in (5, 10)}


def test_a_damaged_newest_durable_copy_resumes_from_the_intact_one_before_it_saying_so(tmp_path, caplog):
    from lightning_ft import EmergencyCheckpoint
    from lightning_ft.checkpoint import MemoryCheckpointIO

    from ckpt_helpers import resume_probe

    durable = str(tmp_path / "durable")
    shards = _fit_to_durable_steps(tmp_path, durable)
    _damage(shards[10])
    # a new node: an empty snapshot root; before, every relaunch picked step 10, failed its check and stopped
    probe = resume_probe()
    io = MemoryCheckpointIO(root=str(tmp_path / "shm3"), run_id="t", persist_to=durable)
    trainer = _fit(11, [probe], ckpt_path="mem://latest", plugins=[io])
    assert probe.start_step == 5 and trainer.global_step == 11
    caplog.clear()
    probe = resume_probe()
    with caplog.at_level(logging.INFO, logger="lightning_ft"):
        trainer = _fit(13, [EmergencyCheckpoint(root=str(tmp_path / "shm2"), run_id="t", persist_to=durable), probe])
    assert probe.start_step == 5 and trainer.global_step == 13
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "durable step 10 is damaged (rank 0: " in warnings[0] and "data checksum mismatch" in warnings[0]
    assert warnings[0].endswith("; resuming from step 5, the newest intact copy before it")
    assert "resume step 5 from the durable tier" in caplog.text


def test_when_every_durable_copy_is_damaged_the_job_stops_naming_them_never_from_step_0(tmp_path):
    from lightning_ft import EmergencyCheckpoint
    from lightning_ft.checkpoint import MemoryCheckpointIO

    from ckpt_helpers import resume_probe

    durable = str(tmp_path / "durable")
    for shard in _fit_to_durable_steps(tmp_path, durable).values():
        _damage(shard)
    with pytest.raises(RuntimeError, match=r"every durable copy .* is damaged \(steps 10, 5\)") as raised:
        _fit(13, [EmergencyCheckpoint(root=str(tmp_path / "shm2"), run_id="t", persist_to=durable)])
    assert "step 10: rank 0: " in str(raised.value) and "to start over from step 0" in str(raised.value)
    io = MemoryCheckpointIO(root=str(tmp_path / "shm3"), run_id="t", persist_to=durable)
    with pytest.raises(FileNotFoundError, match=r"every durable copy .* is damaged \(steps 10, 5\)"):
        _fit(11, [], ckpt_path="mem://latest", plugins=[io])
    # a checkpoint the user passed is no silent step 0: the job goes on from it
    given = str(tmp_path / "given.ckpt")
    _fit(3, []).save_checkpoint(given)
    probe = resume_probe()
    _fit(4, [EmergencyCheckpoint(root=str(tmp_path / "shm4"), run_id="t", persist_to=durable), probe],
         ckpt_path=given)
    assert probe.start_step == 3


def test_an_unreachable_durable_storage_is_not_a_damaged_copy(tmp_path, stores, monkeypatch, caplog):
    from lightning_ft.checkpoint.exchange.agreement import resume_from_newest_intact

    tier = tier_at(tmp_path)
    for step in (10, 20):
        tier.upload(stores[0].save(state(float(step)), step), "seg", world_size=1)
    fresh = SnapshotStore(tmp_path / "new-shm", run_id="job", rank=0)
    read = tier.target.read

    def refused(path):
        if path.endswith(".snap"):
            raise OSError("connection refused")
        return read(path)

    monkeypatch.setattr(tier.target, "read", refused)
    # the storage went away between listing and download: unknown, so no older step is tried
    with caplog.at_level(logging.WARNING, logger="lightning_ft"), \
            pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] could not get step 20"):
        resume_from_newest_intact([], tier, fresh, 0)
    assert "damaged" not in caplog.text and fresh.list() == []
    # it cannot be listed: memory as before, and nothing durable counts as seen everywhere
    monkeypatch.setattr(tier.target, "list", lambda path: (_ for _ in ()).throw(OSError("connection reset")))
    choice = resume_from_newest_intact([4], tier, fresh, 0)
    assert (choice.step, choice.tier, choice.damaged) == (4, "memory", ())
    assert not choice.durable_listed_everywhere


def _resume_rank(rank: int, init_file: str, root: str, durable_dir: str, out: str) -> None:
    """One rank of a 2-process gloo job: resume from the newest intact copy, write what it got."""
    import torch.distributed as dist

    from lightning_ft.checkpoint.exchange.agreement import resume_from_newest_intact

    handler = logging.FileHandler(os.path.join(out, f"rank{rank}.log"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("lightning_ft").addHandler(handler)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        store = SnapshotStore(os.path.join(root, f"shm{rank}"), run_id="job", rank=rank, keep_last=2)
        tier = DurableTier(LocalDirTarget(durable_dir), "job")
        choice = resume_from_newest_intact([i.step for i in store.list()], tier, store, rank)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"step": choice.step, "tier": choice.tier, "held": [i.step for i in store.list()]}, f)
        store.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_fall_back_together_when_one_ranks_shard_is_damaged(tmp_path):
    import multiprocessing

    tier = tier_at(tmp_path)
    writers = [SnapshotStore(tmp_path / f"shm{r}" if r == 0 else tmp_path / "old-shm1", run_id="job", rank=r,
                             keep_last=2) for r in (0, 1)]
    for step in (10, 20):
        for s in writers:
            tier.upload(s.save(state(float(step)), step), "seg", world_size=2)
    for s in writers:
        s.close()
    _damage(tmp_path / "durable/job/steps/step-000000000020/seg/rank1.snap")
    # rank 0 holds 10 and 20 in memory, rank 1 (a new node) nothing: 20 is agreed, rank 1's copy is damaged
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_resume_rank, args=(r, str(tmp_path / "init"), str(tmp_path),
                                                        str(tmp_path / "durable"), str(tmp_path)))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got == [{"step": 10, "tier": "memory", "held": [20, 10]}, {"step": 10, "tier": "durable", "held": [10]}]
    for r in (0, 1):  # every rank says why, in one line, though only rank 1 read the damaged shard
        lines = (tmp_path / f"rank{r}.log").read_text().splitlines()
        assert len(lines) == 1 and "durable step 20 is damaged (rank 1: " in lines[0], lines
        assert "data checksum mismatch" in lines[0] and lines[0].endswith("resuming from step 10, the newest intact "
                                                                          "copy before it")


def test_the_finish_of_a_run_is_recorded_sealed_and_only_its_own_counts(tmp_path, caplog):
    from lightning_ft.schema.signing import Signer

    tier = tier_at(tmp_path)
    assert tier.finished() is None
    tier.mark_finished(400, 7)
    assert tier.finished() == (400, 7)
    other = DurableTier(LocalDirTarget(str(tmp_path / "durable")), "another-job")
    assert other.finished() is None  # another run's finish is not this one's
    # with a job secret, a record written without it (or tampered with) is skipped, loudly
    sealed = DurableTier(LocalDirTarget(str(tmp_path / "durable")), "job", signer=Signer(b"the-job-secret"))
    with caplog.at_level("WARNING"):
        assert sealed.finished() is None
    assert "finished record" in caplog.text
    sealed.mark_finished(500, 8)
    assert sealed.finished() == (500, 8)
    (tmp_path / "durable" / "job" / "finished.json").write_bytes(b"{not json")
    assert tier.finished() is None

"""The snapshot service the strategy and a hot spare ask (lightning_ft.checkpoint.service), in one process."""

from __future__ import annotations

import torch

from lightning_ft.checkpoint.identity import ExpectedIdentity, state_dict_fingerprint
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.service import SnapshotService, replica_puller
from lightning_ft.schema.encryption import ReplicaCipher
from lightning_ft.schema.signing import Signer


def test_open_store_for_a_rank_opens_that_ranks_directory_of_the_run(tmp_path):
    service = SnapshotService(str(tmp_path), "job", keep_last=3)
    with service.open_store_for(2) as store:
        assert (store.rank, store.run_id, store.keep_last) == (2, "job", 3)
        assert store.rank_dir == str(tmp_path / "job" / "rank2")


def test_exchange_on_a_single_rank_records_the_plan_and_sends_nothing(tmp_path):
    service = SnapshotService(str(tmp_path), "job", keep_last=2)
    with service.open_store_for(0) as store:
        store.save({"w": torch.ones(3)}, step=4)
    events = []
    plan = service.exchange(0, 1, lambda event, **fields: events.append((event, fields)))
    assert (plan.step, plan.source, plan.receivers) == (4, 0, ())
    assert events == [("snapshot_plan", {"step": 4, "source": 0, "receivers": []})]
    assert service.exchange(0, 1, lambda event, **fields: None).step == 4  # nothing moved, nothing lost


def test_a_run_without_a_run_id_exchanges_nothing(tmp_path):
    # EmergencyCheckpoint.run_id is "default" then; its snapshots record no run id
    SnapshotStore(tmp_path, run_id=None, rank=0).save({"w": torch.ones(3)}, step=4)
    plan = SnapshotService(str(tmp_path), "default", keep_last=2).exchange(0, 1, lambda event, **fields: None)
    assert plan is None


def test_a_spare_keeps_replicas_in_rank_0s_directory_or_none_without_a_service_or_a_secret(tmp_path):
    service = SnapshotService(str(tmp_path), "job", keep_last=2)
    cipher = ReplicaCipher.for_job(Signer(b"secret"))
    puller = replica_puller(service, "rack-a", 1, lambda *a, **k: None, cipher=cipher, model="f" * 16, max_bytes=10)
    with puller._open_snapshot_store() as store:
        assert (store.rank, store.run_id) == (0, "job")
    assert (puller.expected, puller.max_bytes) == (ExpectedIdentity("job", "f" * 16), 10)
    assert replica_puller(None, "rack-a", 1, lambda *a, **k: None, cipher=cipher, model=None, max_bytes=10) is None
    assert replica_puller(service, "rack-a", 1, lambda *a, **k: None, cipher=None, model=None, max_bytes=10) is None


def test_the_exchange_offers_only_snapshots_of_the_model_when_it_is_known(tmp_path):
    service = SnapshotService(str(tmp_path), "job", keep_last=3)
    with service.open_store_for(0) as store:
        store.save({"state_dict": {"w": torch.ones(3)}}, step=4)
        store.save({"state_dict": {"other": torch.ones(5)}}, step=100_000)  # a copy of another model
    model = state_dict_fingerprint({"w": torch.ones(3)})
    assert service.exchange(0, 1, lambda event, **fields: None, model=model).step == 4
    assert service.exchange(0, 1, lambda event, **fields: None).step == 100_000  # model unknown: run id only


def test_the_emergency_checkpoint_hands_out_its_run_as_a_service(tmp_path):
    from lightning_ft.checkpoint import EmergencyCheckpoint

    snapshots = EmergencyCheckpoint(root=str(tmp_path), run_id="job", keep_last=4).snapshots
    assert (snapshots.root, snapshots.run_id, snapshots.keep_last) == (str(tmp_path), "job", 4)


def test_the_model_is_known_before_setup_unless_configure_model_builds_it():
    import lightning.pytorch as pl

    from lightning_ft.checkpoint.lightning.auto_resume import model_fingerprint_before_setup

    class Built(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 3)

    class Lazy(Built):
        def configure_model(self) -> None:
            self.extra = torch.nn.Linear(3, 1)

    assert model_fingerprint_before_setup(Built()) == state_dict_fingerprint(Built().state_dict())
    assert model_fingerprint_before_setup(Lazy()) is None and model_fingerprint_before_setup(None) is None

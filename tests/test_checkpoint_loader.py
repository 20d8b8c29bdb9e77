"""The snapshot format's restricted loader: no code from a file runs, refusals say what to do,
what it cannot read back is refused at save time, and real Lightning checkpoints round-trip."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import sys
import time
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.cli import LightningCLI, LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.checkpoint import SnapshotError, SnapshotStore
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.restricted_pickle import allowed_globals, default_allowed_globals

from ckpt_helpers import tensors_equal

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@dataclasses.dataclass
class UserConfig:
    """A user's hparams type: not in torch's allow-list."""

    depth: int = 2


class _RunsCommand:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def write_crafted(store: SnapshotStore, step: int, meta: bytes, run_id: str | None = None) -> str:
    """A snapshot file with valid header and checksums around arbitrary metadata bytes."""
    identity = fmt.encode_identity(store.configured_run_id if run_id is None else run_id, store.rank, "")
    meta_off = fmt._align(fmt.HEADER_SIZE + len(identity), 8)
    data_off = fmt._align(meta_off + len(meta), fmt.PAGE)
    enc = fmt.Encoded(identity, meta, [], meta_off, data_off, 0, 0)
    blob = fmt.finish(enc, step, time.time(), torch.empty(0, dtype=torch.int64)).ljust(data_off, b"\0")
    os.makedirs(store.rank_dir, mode=0o700, exist_ok=True)
    path = os.path.join(store.rank_dir, f"step-{step:012d}.snap")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    return path


@pytest.fixture
def store(tmp_path):
    with SnapshotStore(root=tmp_path / "shm", run_id="loader", rank=0) as s:
        yield s


def test_a_crafted_snapshot_that_runs_a_command_under_plain_pickle_is_refused(store, tmp_path, caplog):
    marker = tmp_path / "pwned"
    meta = pickle.dumps({"state_dict": {}, "x": _RunsCommand(f"touch {marker}")}, protocol=5)
    path = write_crafted(store, 7, meta)
    info = store.list()[0]
    assert store.verify(info) is None  # header and checksums are valid: only decoding can catch it

    with pytest.raises(SnapshotError, match=r"posix\.system.*never allowed"):
        store.load(info)
    with torch.serialization.safe_globals([os.system]):  # not even when a user allows it
        with pytest.raises(SnapshotError, match=r"posix\.system"):
            store.load(info)
    assert not marker.exists()
    # what the old loader (plain pickle) would have done with the same bytes:
    with open(path, "rb") as f:
        blob = f.read()
    header = fmt.verify(blob, len(blob))
    pickle.loads(blob[header.meta_off: header.meta_off + header.meta_len])
    assert marker.exists()


def test_a_global_outside_the_allow_list_names_itself_and_the_fix(store):
    write_crafted(store, 3, pickle.dumps({"config": UserConfig()}, protocol=5))
    with pytest.raises(SnapshotError) as err:
        store.load()
    message = str(err.value)
    assert "test_checkpoint_loader.UserConfig" in message
    assert "torch.serialization.add_safe_globals([UserConfig])" in message
    with torch.serialization.safe_globals([UserConfig]):
        assert store.load()["config"] == UserConfig()
    write_crafted(store, 4, pickle.dumps({"f": eval}, protocol=5))
    with pytest.raises(SnapshotError, match=r"builtins\.eval"):
        store.load(store.find(4))


def test_save_refuses_what_the_loader_would_refuse_and_writes_nothing(store):
    with pytest.raises(SnapshotError, match=r"UserConfig.*add_safe_globals"):
        store.save({"hyper_parameters": {"config": UserConfig()}}, step=1)
    assert store.list() == []
    with torch.serialization.safe_globals([UserConfig]):
        store.save({"hyper_parameters": {"config": UserConfig(3)}}, step=1)
        assert store.load()["hyper_parameters"]["config"] == UserConfig(3)


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("make, what", [
    (lambda: torch.eye(3).to_sparse(), "sparse_coo tensor"),
    (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr tensor"),
    (lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8), "quantized tensor"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"),
    (lambda: torch.ones(2).as_subclass(_Subclass), "tensor subclass"),
    (lambda: torch.empty(4, device="meta"), "meta tensor"),
])
def test_tensors_the_format_cannot_hold_fail_at_save_naming_where(store, make, what):
    state = {"state_dict": {"layer.weight": torch.ones(2), "odd": make()}}
    with pytest.raises(SnapshotError, match=rf"{what}.*\['state_dict'\]\['odd'\]"):
        store.save(state, step=1)
    assert not os.path.exists(store.rank_dir)  # refused before any file was touched


def test_a_file_of_an_older_format_version_is_skipped_with_the_reason_never_loaded(store, caplog):
    store.save({"w": torch.ones(3)}, step=1)
    newer = store.save({"w": torch.zeros(3)}, step=2)
    with open(newer.path, "r+b") as f:
        f.seek(8)
        f.write((1).to_bytes(4, "little"))  # format version 1 (no identity record)
    with caplog.at_level(logging.WARNING, logger="lightning_ft.checkpoint.memory"):
        assert store.latest().step == 1
    assert any("format version 1" in r.message and "not loaded" in r.message for r in caplog.records)
    with pytest.raises(SnapshotError, match="format version 1"):
        store.load(newer)


@pytest.mark.parametrize("pid, match", [
    (("t", 0, "float32", (1000,), 0, 4000, False, False), "bad tensor placeholder"),   # beyond the data
    (("t", 0, "float32", (10**12,), 0, 4 * 10**12, False, False), "bad tensor placeholder"),  # never allocated
    (("t", 0, "load", (1,), 0, 4, False, False), "bad tensor placeholder"),           # torch.load is no dtype
    (("t", 0, "float32", (2,), 0, 4, False, False), "bad tensor placeholder"),        # size != shape
    (("t", 0, "float32", (-1, -1), 0, 4, False, False), "bad tensor placeholder"),    # no room for it either
    (("x", 0), "bad tensor placeholder"),
])
def test_tensor_placeholders_are_checked_against_the_data_region(store, pid, match):
    class Placeholders(pickle.Pickler):
        def persistent_id(self, obj):
            return pid if obj == "TENSOR" else None

    buf = io.BytesIO()
    Placeholders(buf, protocol=5).dump({"w": "TENSOR"})
    write_crafted(store, 1, buf.getvalue())
    with pytest.raises(SnapshotError, match=match):
        store.load()


def test_the_allow_list_is_torchs_without_tensor_rebuild_machinery_plus_user_additions():
    base = default_allowed_globals()
    expected = {"collections.OrderedDict", "collections.Counter", "builtins.set", "torch.device", "torch.float32"}
    assert expected <= set(base)
    assert not any(name.startswith("torch._utils._rebuild") for name in base)
    assert "torch.Tensor" not in base and "torch.FloatStorage" not in base and "posix.system" not in base
    assert f"{__name__}.UserConfig" not in allowed_globals()
    with torch.serialization.safe_globals([UserConfig]):
        assert allowed_globals()[f"{__name__}.UserConfig"] is UserConfig


# ------------------------------------------------------------------------------------- real Lightning checkpoints


class _RecordGlobals(pickle.Unpickler):
    def __init__(self, file) -> None:
        super().__init__(file)
        self.names: set[str] = set()

    def find_class(self, module, name):
        self.names.add(f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        return None


def globals_named(checkpoint) -> set[str]:
    recorder = _RecordGlobals(io.BytesIO(fmt.encode(checkpoint).meta))
    recorder.load()
    return recorder.names


class _Grab(pl.Callback):
    def __init__(self) -> None:
        self.checkpoint = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def _data(n: int = 32) -> TensorDataset:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True))


class RealisticModule(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, hidden: int = 16, name: str = "m", betas: tuple = (0.9, 0.99),
                 schedule: str = "lambda", extra: dict | None = None, loader: str = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.mse = torchmetrics.MeanSquaredError()
        self.mean = torchmetrics.MeanMetric()
        self.collection = torchmetrics.MetricCollection({"mae": torchmetrics.MeanAbsoluteError()})
        for metric in (self.mse, self.mean, self.collection):
            metric.persistent(True)  # metric states in the state_dict, as users who resume metrics do

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = nn.functional.mse_loss(out, y)
        self.mse(out, y)
        self.mean(loss)
        self.collection(out, y)
        self.log("train_loss", loss)
        self.log("mse", self.mse)
        self.log_dict(self.collection)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, betas=tuple(self.hparams.betas))
        schedulers = torch.optim.lr_scheduler
        kind = self.hparams.schedule
        if kind == "lambda":
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedulers.LambdaLR(opt, lambda e: 0.9 ** e),
                                                       "interval": "step"}}
        if kind == "onecycle":
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedulers.OneCycleLR(opt, 0.1, total_steps=50),
                                                       "interval": "step"}}
        if kind == "plateau":
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedulers.ReduceLROnPlateau(opt, patience=1),
                                                       "monitor": "val_loss"}}
        if kind == "multistep":  # its milestones are a collections.Counter
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedulers.MultiStepLR(opt, [2, 4]),
                                                       "interval": "step"}}
        raise ValueError(kind)

    def train_dataloader(self):
        if self.hparams.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(_data(), batch_size=4, shuffle=True)
        return DataLoader(_data(), batch_size=4)

    def val_dataloader(self):
        return DataLoader(_data(8), batch_size=4)


def _checkpoint_of(tmp_path: Path, module: pl.LightningModule, callbacks=(), **trainer_kwargs) -> dict:
    from lightning.pytorch.loggers import CSVLogger

    grab = _Grab()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=trainer_kwargs.pop("max_steps", 5),
                         val_check_interval=3, num_sanity_val_steps=0, enable_progress_bar=False,
                         enable_model_summary=False, logger=CSVLogger(tmp_path / "logs"),
                         default_root_dir=tmp_path, callbacks=[*callbacks, grab], **trainer_kwargs)
    trainer.fit(module)
    return grab.checkpoint


def _cli_checkpoint(tmp_path: Path) -> dict:
    """LightningCLI with the realistic user script and its YAML, plus dependency-injected optimizer
    and scheduler classes (the CLI stores them as class_path/init_args hparams)."""
    with mock.patch.object(sys, "path", [str(SCRIPTS), *sys.path]), \
            mock.patch.dict(os.environ, LU_OUT=str(tmp_path / "lu_out")):
        import lightning_user as user

        class InjectedModel(user.UserModel):
            def __init__(self, optimizer: OptimizerCallable = torch.optim.Adam,
                         scheduler: LRSchedulerCallable = torch.optim.lr_scheduler.ConstantLR, hidden: int = 64,
                         lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 20,
                         total_steps: int = 400) -> None:
                super().__init__(hidden, lr, weight_decay, warmup_steps, total_steps)
                self.save_hyperparameters()
                self.optimizer, self.scheduler = optimizer, scheduler

            def configure_optimizers(self):
                opt = self.optimizer(self.parameters())
                return {"optimizer": opt, "lr_scheduler": self.scheduler(opt)}

        grab = _Grab()
        cli = LightningCLI(InjectedModel, user.UserDataModule, run=False, args=[
            "--config", str(SCRIPTS / "user_cli.yaml"), "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "4",
            "--model.optimizer=torch.optim.SGD", "--model.optimizer.lr=0.01",
            "--model.scheduler=torch.optim.lr_scheduler.StepLR", "--model.scheduler.step_size=3"])
        cli.trainer.callbacks.append(grab)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert grab.checkpoint["hyper_parameters"]["optimizer"]["class_path"] == "torch.optim.SGD"
    return grab.checkpoint


def _lightning_callbacks(tmp_path: Path) -> list:
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, Timer

    return [ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="val_loss", save_top_k=2, save_last=True,
                            every_n_train_steps=2),
            EarlyStopping(monitor="val_loss", patience=5), LearningRateMonitor(logging_interval="step"), Timer()]


REALISTIC = {
    "hparams+LambdaLR+callbacks+torchmetrics+bf16-mixed+clip-norm": lambda tmp: _checkpoint_of(
        tmp, RealisticModule(extra={"layers": [1, 2], "dropout": None}), _lightning_callbacks(tmp),
        precision="bf16-mixed", gradient_clip_val=0.5),
    # fp16 AMP on CPU only through an explicit plugin (precision="16-mixed" falls back to bf16 there)
    "OneCycleLR+StatefulDataLoader+16-mixed-GradScaler+clip-value": lambda tmp: _checkpoint_of(
        tmp, RealisticModule(schedule="onecycle", loader="stateful"),
        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))], gradient_clip_val=1.0,
        gradient_clip_algorithm="value"),
    "ReduceLROnPlateau+accumulation": lambda tmp: _checkpoint_of(
        tmp, RealisticModule(schedule="plateau"), accumulate_grad_batches=2, max_steps=3),
    "MultiStepLR+bf16-true": lambda tmp: _checkpoint_of(
        tmp, RealisticModule(schedule="multistep"), precision="bf16-true"),
    "LightningCLI": _cli_checkpoint,
}


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_real_lightning_checkpoints_round_trip_through_the_restricted_loader(name, tmp_path):
    checkpoint = REALISTIC[name](tmp_path)
    if "GradScaler" in name:
        assert checkpoint["MixedPrecision"]["scale"] > 0
    assert globals_named(checkpoint) <= {"collections.OrderedDict", "collections.Counter"}, name
    with SnapshotStore(root=tmp_path / "shm", run_id="real", rank=0) as store:
        info = store.save(checkpoint, step=checkpoint["global_step"])
        loaded = store.load(expect=store.expected_identity())
        # a peer or spare receiving it checks its metadata (tensors as shapes only) and keeps it
        with SnapshotStore(root=tmp_path / "peer", run_id="real", rank=1) as peer:
            assert peer.load(peer.write_bytes(store.read_bytes(info)))["global_step"] == checkpoint["global_step"]
    assert tensors_equal(loaded, checkpoint)


def test_a_received_snapshot_the_loader_would_refuse_is_never_kept(store, tmp_path):
    marker = tmp_path / "pwned"
    meta = pickle.dumps({"state_dict": {}, "x": _RunsCommand(f"touch {marker}")}, protocol=5)
    with open(write_crafted(store, 7, meta), "rb") as f:
        blob = f.read()
    with SnapshotStore(root=tmp_path / "spare", run_id="loader", rank=1) as spare:
        with pytest.raises(SnapshotError, match=r"received snapshot of step 7: .*posix\.system.*not stored"):
            spare.write_bytes(blob)
        assert spare.list() == [] and not marker.exists()
        # an unknown global too: refused at the door, not first when the spare needs it to resume
        with open(write_crafted(store, 8, pickle.dumps({"config": UserConfig()}, protocol=5)), "rb") as f:
            with pytest.raises(SnapshotError, match="UserConfig"):
                spare.write_bytes(f.read())
        assert spare.list() == []


def test_no_snapshot_path_uses_an_unrestricted_unpickler(tmp_path, monkeypatch):
    """Every way a snapshot is read -- from its file, as bytes from a peer or the store -- goes
    through the restricted loader: with every unrestricted decoder made to fail, they all work."""
    import torch.distributed as dist

    from lightning_ft import EmergencyCheckpoint
    from lightning_ft.checkpoint import MemoryCheckpointIO
    from lightning_ft.checkpoint.exchange.agreement import agree_on_step
    from lightning_ft.checkpoint.exchange.replication import read_snapshot_file

    from ckpt_helpers import make_module, resume_probe, trainer_kwargs

    def forbidden(*args, **kwargs):
        raise AssertionError("an unrestricted unpickler was used")

    class ForbiddenUnpickler:
        def __init__(self, *args, **kwargs):
            forbidden()

    for module, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load"),
                         (dist, "all_gather_object"), (dist, "broadcast_object_list")):
        monkeypatch.setattr(module, name, ForbiddenUnpickler if name == "Unpickler" else forbidden)
    root = tmp_path / "shm"
    trainer = pl.Trainer(**trainer_kwargs(max_steps=6, callbacks=[EmergencyCheckpoint(every_n_steps=3, root=str(root),
                                                                                      run_id="guard")]))
    trainer.fit(make_module())
    store = SnapshotStore(root=root, run_id="guard", rank=0)
    expect = store.expected_identity()
    assert store.scan(include_peers=True, expect=expect).readable == [3, 6]
    assert agree_on_step(store.readable_steps(include_peers=True, expect=expect), store.rank) == 6
    assert store.load(expect=expect)["global_step"] == 6
    blob = read_snapshot_file(store.find(6).path)
    receiver = SnapshotStore(root=tmp_path / "spare", run_id="guard", rank=1)
    assert receiver.load(receiver.write_bytes(store.read_bytes(store.find(3))))["global_step"] == 3
    assert receiver.write_bytes(blob).step == 6
    assert MemoryCheckpointIO(root=str(root), run_id="guard").load_checkpoint("mem://latest")["global_step"] == 6
    probe = resume_probe()
    trainer = pl.Trainer(**trainer_kwargs(max_steps=8, callbacks=[EmergencyCheckpoint(root=str(root), run_id="guard"),
                                                                  probe]))
    trainer.fit(make_module())
    assert probe.start_step == 6


# ------------------------------------------------------------------ effects, not only names (issue 24)


def test_a_snapshot_cannot_set_attributes_of_an_allowed_class(store):
    """Counter is allowed, but a BUILD applied to the class itself would change it for the whole
    process (the old loader accepted ``Counter.most_common = None`` from 60 bytes of metadata)."""
    from collections import Counter

    meta = (b"\x80\x04\x8c\x0bcollections\x94\x8c\x07Counter\x94\x93\x94}\x94\x8c\x0bmost_common\x94Nsb"
            b"\x85\x94.")
    write_crafted(store, 5, meta)
    original = Counter.most_common
    with pytest.raises(SnapshotError, match=r"sets the state of collections\.Counter itself"):
        store.load()
    assert Counter.most_common is original and callable(Counter("aab").most_common)


def test_a_snapshot_cannot_make_the_loader_allocate_without_bound(store):
    """``bytearray(2**31)`` is 30 bytes of pickle; refused before anything is constructed."""
    meta = b"\x80\x04\x8c\x08builtins\x94\x8c\tbytearray\x94\x93\x94\x8a\x05\x00\x00\x00\x80\x00\x85\x94R\x94."
    write_crafted(store, 6, meta)
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(SnapshotError, match=r"builtins\.bytearray\(2147483648\), an allocation beyond"):
        store.load()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB: nothing big


def test_tensor_classes_torch_registers_on_import_are_not_allowed():
    """Importing torch.distributed.tensor or torch.nested makes torch add DTensor and NestedTensor to
    its own safe globals; this format never pickles a tensor, so the loader refuses them anyway."""
    import torch.distributed.tensor
    import torch.nested  # noqa: F401

    from lightning_ft.checkpoint.restricted_pickle import allowed_globals

    names = set(allowed_globals())
    assert not {n for n in names if "DTensor" in n or "NestedTensor" in n or n.startswith("torch.nested")}, names
    assert "collections.OrderedDict" in names and "torch.Size" in names

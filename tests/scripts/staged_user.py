"""A user's whole Lightning script under ``ddp_ft``: fit, test, a second fit with a fresh Trainer,
validate, predict -- five stages of one job. The test runs on the first fit's best checkpoint
(``ckpt_path="best"``, a ``ModelCheckpoint`` of the first Trainer).

    python staged_user.py --out DIR [--steps N] [--kill-stage K --kill-step S] [--step-sleep S]

The LightningModule and the data are the same on every process; the job's settings come from the
LIGHTNING_FT_* variables. ``--kill-stage K --kill-step S``: the process that is global rank 0 in
stage K SIGKILLs itself at step S of that stage (a fit; its batch S in an evaluation) -- a node
lost in the middle of that stage, once in the job. ``--bug-stage K``: training raises a
``ValueError`` at step 2 of stage K on every rank (a bug in the user's code); the script catches
what each call raises and records its type (``{"raised": "ValueError"}``) instead of a result.
``--crash-after-stage K``: the process that was global rank 0 in stage K raises (uncaught) right
after that stage returned -- a bug in the user's code between two stages.

Writes ``result-<pid>.json`` into ``--out`` when the script ends: what every stage returned
(``None`` for a fit; the metrics or the number of predictions, ``[]`` on a participant that stood
by), whether this process trained in each fit, its final global step and a digest of its weights.
Before the second ``fit()`` it writes ``second-fit-<pid>``, and that fit's first step waits until
``DIR/go`` exists (up to 60 s): a test lets it go once every participant reached that stage.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ft  # noqa: F401  (registers the strategies)


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(64, 8, generator=generator)
        self.y = (self.x.sum(dim=1) > 0).long()

    def _loader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=8, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


class Classifier(pl.LightningModule):
    def __init__(self, kill: tuple[int, int] | None, go: Path, step_sleep: float, bug_stage: int | None) -> None:
        super().__init__()
        self.go, self.step_sleep, self.bug_stage = go, step_sleep, bug_stage
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.kill = kill
        self.stage = 0  # which of the script's stages runs now (set by main)

    def _maybe_die(self, position: int) -> None:
        if self.kill == (self.stage, position) and self.trainer.global_rank == 0:
            try:  # once in the job: the new rank 0 redoing this batch after the recovery lives on
                os.close(os.open(self.go.with_name("killed"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)

    def _loss_and_accuracy(self, batch):
        x, y = batch
        logits = self.net(x)
        return nn.functional.cross_entropy(logits, y), (logits.argmax(dim=1) == y).float().mean()

    def training_step(self, batch, batch_idx):
        if self.stage == 2 and batch_idx == 0 and self.trainer.global_step == 0:
            deadline = time.monotonic() + 60
            while not self.go.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        time.sleep(self.step_sleep)
        self._maybe_die(self.trainer.global_step)
        if self.stage == self.bug_stage and self.trainer.global_step == 2:
            raise ValueError("a bug in training_step")
        loss, _ = self._loss_and_accuracy(batch)
        return loss

    def validation_step(self, batch, batch_idx):
        self._maybe_die(batch_idx)
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log_dict({"val_loss": loss, "val_acc": accuracy}, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self._maybe_die(batch_idx)
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log_dict({"test_loss": loss, "test_acc": accuracy}, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        self._maybe_die(batch_idx)
        return self.net(batch[0]).argmax(dim=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(root: Path, max_steps: int, checkpoints: Path | None = None) -> pl.Trainer:
    callbacks = [ModelCheckpoint(dirpath=str(checkpoints))] if checkpoints is not None else []
    return pl.Trainer(strategy="ddp_ft", accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1,
                      default_root_dir=str(root), logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=checkpoints is not None, callbacks=callbacks, num_sanity_val_steps=0,
                      limit_val_batches=4, limit_test_batches=4,
                      limit_predict_batches=4, val_check_interval=None, check_val_every_n_epoch=None)


def digest(module: nn.Module) -> str:
    data = b"".join(p.detach().to(torch.float64).numpy().tobytes() for p in module.parameters())
    return hashlib.sha256(data).hexdigest()[:16]


def plain(results) -> object:
    """Stage results as JSON: metrics dicts as they are, predictions as how many there are."""
    if results is None:
        return None
    if results and isinstance(results[0], torch.Tensor):
        return {"predictions": sum(len(r) for r in results)}
    return [{k: round(float(v), 6) for k, v in r.items()} for r in results]


def call(method, *args, **kwargs) -> object:
    """A Trainer call's results as JSON, or the type of the exception it raised (caught, as a
    script that goes on after a failed stage does)."""
    try:
        return plain(method(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - recorded: the test reads it
        return {"raised": type(exc).__name__}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kill-stage", type=int, default=None)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--bug-stage", type=int, default=None)
    parser.add_argument("--crash-after-stage", type=int, default=None)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test's stack dump of a hang
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kill = (args.kill_stage, args.kill_step) if args.kill_stage is not None else None
    model, data = Classifier(kill, out / "go", args.step_sleep, args.bug_stage), Data()
    returned, trained = [], []

    # the first fit saves Lightning checkpoints to a directory every participant reads (one host here)
    first = trainer(out / f"root-{os.getpid()}", args.steps, checkpoints=out / "checkpoints")
    model.stage = 0
    returned.append(call(first.fit, model, datamodule=data))
    if args.crash_after_stage == 0 and first.global_rank == 0:
        raise RuntimeError("a bug in the script after its first stage")
    trained.append(bool(first.strategy.trained))
    model.stage = 1
    returned.append(call(first.test, model, datamodule=data, ckpt_path="best"))

    (out / f"second-fit-{os.getpid()}").touch()
    second = trainer(out / f"root2-{os.getpid()}", 2 * args.steps)  # a fresh Trainer: the job's second fit
    model.stage = 2
    returned.append(call(second.fit, model, datamodule=data))
    trained.append(bool(second.strategy.trained))
    model.stage = 3
    returned.append(call(second.validate, model, datamodule=data))
    model.stage = 4
    returned.append(call(second.predict, model, datamodule=data))

    result = {"pid": os.getpid(), "returned": returned, "trained": trained, "step": second.global_step,
              "weights": digest(model)}
    (out / f"result-{os.getpid()}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

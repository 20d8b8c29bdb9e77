"""A small training job with in-memory snapshots, for the tests of whose snapshot a job may resume.

    python snapshot_job.py --out OUT --root SNAPSHOT_ROOT [--run-id ID] [--lr LR] [--seed S]
        [--hidden H] [--max-steps N] [--snapshot-every K] [--keep-last N] [--ckpt-path mem://...]
        [--wait-for FILE] [--persist-to DIR]

Without ``--run-id`` the run id comes from the environment (or there is none). ``--ckpt-path``
adds a ``MemoryCheckpointIO``. ``--wait-for`` blocks before ``fit()`` until FILE exists, so a test
can act on this process's pid first. ``OUT/result.json`` after ``fit()``: ``start_step`` (the step
training started from), ``end_step``, ``trained_steps`` (optimizer steps run by this process) and
``first_loss``. ``--persist-to`` copies every snapshot durably there (``persist_every_n_seconds=0``)
and waits for the copies after ``fit()``. lightning_ft logs at INFO on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--run-id", default=None)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--snapshot-every", type=int, default=5)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--ckpt-path", default=None)
    p.add_argument("--wait-for", default=None)
    p.add_argument("--persist-to", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s: %(message)s")
    logging.getLogger("lightning_ft").setLevel(logging.INFO)

    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import EmergencyCheckpoint
    from lightning_ft.checkpoint import MemoryCheckpointIO

    class Job(pl.LightningModule):
        def __init__(self, hidden: int, lr: float) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            x = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.start_step: int | None = None
            self.trained = 0
            self.first_loss: float | None = None

        def on_train_start(self, trainer, pl_module):
            self.start_step = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.trained += 1
            if self.first_loss is None:
                self.first_loss = float(outputs["loss"])

    if args.wait_for:
        while not os.path.exists(args.wait_for):
            time.sleep(0.02)
    torch.manual_seed(args.seed)
    record = Record()
    durable = {"persist_to": args.persist_to, "persist_every_n_seconds": 0} if args.persist_to else {}
    snapshots = EmergencyCheckpoint(every_n_steps=args.snapshot_every, keep_last=args.keep_last, root=args.root,
                                    run_id=args.run_id, **durable)
    callbacks = [snapshots, record]
    plugins = [MemoryCheckpointIO(root=args.root, run_id=args.run_id)] if args.ckpt_path else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.max_steps, max_epochs=-1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=callbacks, plugins=plugins)
    trainer.fit(Job(args.hidden, args.lr), ckpt_path=args.ckpt_path)
    if snapshots.persister is not None and not snapshots.persister.wait_idle(60):
        raise SystemExit("durable copies did not finish within 60 s")
    result = {"start_step": record.start_step, "end_step": trainer.global_step, "trained_steps": record.trained,
              "first_loss": record.first_loss}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

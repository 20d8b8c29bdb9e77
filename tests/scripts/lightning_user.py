"""A realistic Lightning user script, for testing ``ddp_ft`` recovery fidelity (issue 14).

What a Lightning user typically writes, nothing lightning_ft-specific in the model or data:

* ``LightningModule`` with ``save_hyperparameters()``, ``self.log("train_loss")`` every step,
  a torchmetrics ``MulticlassAccuracy`` logged as ``val_acc`` (``sync_dist=True``), a
  ``val_loss``, AdamW + a per-step LR scheduler (warm-up then cosine);
* ``LightningDataModule`` with synthetic, seeded data (no download);
* ``Trainer(val_check_interval=50 batches, check_val_every_n_epoch=None,
  accumulate_grad_batches=2, gradient_clip_val=1.0, log_every_n_steps=5)``;
* ``ModelCheckpoint(every_n_train_steps=25, save_last=True, monitor="val_acc", mode="max",
  save_top_k=2)``, ``CSVLogger`` (+ ``TensorBoardLogger`` with ``--tensorboard``),
  ``LearningRateMonitor``.

Modes:

* ``python lightning_user.py --strategy ddp_ft ...``: one process per participant, the
  ``ddp_ft`` settings from ``LIGHTNING_FT_*`` variables (endpoint, run id, nnodes, domain,
  snapshot dir, events dir, infra rank);
* ``--strategy ddp --devices N`` under ``torchrun`` (plain DDP), ``--strategy auto`` (1 process);
* ``lightning_user_cli.py`` runs the same classes through ``LightningCLI`` (see there).

Test hooks (the ``Probe`` callback, knobs from the command line or ``LU_*`` variables):

* ``OUT/progress-<pid>.jsonl``: one line per event ``{"t","pid","rank","ev","step",...}`` with
  ``ev`` in setup / train_start / step / val_batch / val_end / save / fit_end, so a harness can
  kill at a chosen moment;
* delays: ``--step-sleep`` (every training batch), ``--val-sleep`` (every validation batch),
  ``--save-sleep`` (inside a ModelCheckpoint save, before the file is written),
  ``--setup-sleep`` (in ``DataModule.setup``); ``--sleep-from-step`` / ``--sleep-until-step``
  limit them to a step window;
* ``OUT/result-<pid>.json`` after ``fit()``: rank, trained flag, global step, weights digest,
  recoveries, log dir, best-k models, callback metrics; ``OUT/exit-<pid>`` on ``SystemExit``;
* SIGUSR1 dumps every thread's stack (faulthandler) into the process's stderr.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

faulthandler.register(signal.SIGUSR1, all_threads=True)

import lightning.pytorch as pl  # noqa: E402
import torchmetrics  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402

# ----------------------------------------------------------------------------- knobs


def _env_float(name: str, default: float | None = None) -> float | None:
    raw = os.environ.get(name)
    return default if raw in (None, "") else float(raw)


class Knobs:
    """Test knobs shared by the script and the CLI mode (CLI: from LU_* variables)."""

    def __init__(self, out: str | None = None, step_sleep: float = 0.0, val_sleep: float = 0.0,
                 save_sleep: float = 0.0, setup_sleep: float = 0.0, sleep_from_step: int = 0,
                 sleep_until_step: int | None = None) -> None:
        self.out = Path(out or os.environ.get("LU_OUT", "lu_out"))
        self.step_sleep = step_sleep or _env_float("LU_STEP_SLEEP", 0.0)
        self.val_sleep = val_sleep or _env_float("LU_VAL_SLEEP", 0.0)
        self.save_sleep = save_sleep or _env_float("LU_SAVE_SLEEP", 0.0)
        self.setup_sleep = setup_sleep or _env_float("LU_SETUP_SLEEP", 0.0)
        self.sleep_from_step = sleep_from_step or int(_env_float("LU_SLEEP_FROM_STEP", 0))
        until = sleep_until_step if sleep_until_step is not None else _env_float("LU_SLEEP_UNTIL_STEP")
        self.sleep_until_step = None if until is None else int(until)
        self.out.mkdir(parents=True, exist_ok=True)

    def in_window(self, step: int) -> bool:
        return step >= self.sleep_from_step and (self.sleep_until_step is None or step <= self.sleep_until_step)


KNOBS: Knobs | None = None


def knobs() -> Knobs:
    global KNOBS
    if KNOBS is None:
        KNOBS = Knobs()
    return KNOBS


def _rank(trainer: Any) -> int:
    try:
        return int(trainer.global_rank)
    except Exception:  # noqa: BLE001 - before the strategy knows
        return -2


def progress(trainer: Any, ev: str, **fields: Any) -> None:
    record = {"t": time.time(), "pid": os.getpid(), "rank": _rank(trainer), "ev": ev,
              "step": int(getattr(trainer, "global_step", 0)) if trainer is not None else 0, **fields}
    with open(knobs().out / f"progress-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------- data


class UserDataModule(pl.LightningDataModule):
    """Synthetic 4-class problem: 16 features, a fixed random teacher network labels them."""

    def __init__(self, batch_size: int = 16, num_train: int = 4096, num_val: int = 512, data_seed: int = 7,
                 loader: str = "plain") -> None:
        super().__init__()
        if loader not in ("plain", "resumable"):
            raise ValueError(f"loader must be 'plain' or 'resumable', got {loader!r}")
        self.save_hyperparameters()
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def prepare_data(self) -> None:
        pass  # nothing to download

    def setup(self, stage: str) -> None:
        k = knobs()
        trainer = self.trainer
        progress(trainer, "setup", stage=stage)
        if k.setup_sleep:
            time.sleep(k.setup_sleep)
        g = torch.Generator().manual_seed(self.hparams.data_seed)
        teacher = torch.randn(16, 4, generator=g)
        n = self.hparams.num_train + self.hparams.num_val
        x = torch.randn(n, 16, generator=g)
        y = (x @ teacher + 0.8 * torch.randn(n, 4, generator=g)).argmax(dim=1)
        cut = self.hparams.num_train
        self.train_set = TensorDataset(x[:cut], y[:cut])
        self.val_set = TensorDataset(x[cut:], y[cut:])

    def train_dataloader(self):
        if self.hparams.loader == "plain":
            # what most users write; Lightning swaps in a DistributedSampler under DDP
            return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)
        from lightning_ft.data import resumable_loader

        return resumable_loader(self.train_set, self.hparams.batch_size, self.trainer, seed=self.hparams.data_seed)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=32, shuffle=False)


# ----------------------------------------------------------------------------- model


class UserModel(pl.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 3e-3, weight_decay: float = 0.01, warmup_steps: int = 20,
                 total_steps: int = 400, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, hidden),
                                 nn.GELU(), nn.Linear(hidden, 4))
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")
        self.val_samples_at_end: list[int] = []  # an attribute outside the state dict, as users keep them

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        k = knobs()
        if k.step_sleep and k.in_window(self.trainer.global_step):
            time.sleep(k.step_sleep)
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        k = knobs()
        progress(self.trainer, "val_batch", batch=batch_idx)
        if k.val_sleep and k.in_window(self.trainer.global_step):
            time.sleep(k.val_sleep)
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        # samples in this rank's metric state before compute (tp + fn = samples for micro accuracy)
        seen = int(self.val_acc.tp.sum() + self.val_acc.fn.sum())
        self.val_samples_at_end.append(seen)
        progress(self.trainer, "val_end", local_samples=seen, sanity=bool(self.trainer.sanity_checking))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warm, total = self.hparams.warmup_steps, self.hparams.total_steps

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ----------------------------------------------------------------------------- test probe


def _inside_model_checkpoint_save() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_save_checkpoint" and frame.f_code.co_filename.endswith("model_checkpoint.py"):
            return True
        frame = frame.f_back
    return False


class DeadlockAt(pl.Callback):
    """At optimizer step ``step`` every rank waits to receive from the other (ranks 0 and 1):
    a user bug that deadlocks, with every rank alive and inside a collective."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or trainer.fit_loop.epoch_loop._should_accumulate():
            return
        import torch.distributed as dist

        dist.recv(torch.zeros(1), src=1 - trainer.global_rank)


class Probe(pl.Callback):
    """Writes progress records and applies the delays (test instrumentation, no state)."""

    def on_train_start(self, trainer, pl_module):
        progress(trainer, "train_start", world=trainer.world_size, state=trainer_state(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        progress(trainer, "step")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if not _inside_model_checkpoint_save():
            return  # an EmergencyCheckpoint snapshot
        progress(trainer, "save")
        k = knobs()
        if k.save_sleep and k.in_window(trainer.global_step):
            time.sleep(k.save_sleep)


def trainer_state(trainer, pl_module) -> dict[str, Any]:
    """What this process holds when training (re)starts: for comparing survivors, spares and relaunches."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    state: dict[str, Any] = {"weights": weights_digest(pl_module)}
    try:
        opt = trainer.optimizers[0]
        steps = [int(v["step"]) for v in opt.state.values() if "step" in v]
        state["optimizer_steps"] = max(steps) if steps else 0
        state["lr"] = opt.param_groups[0]["lr"]
        state["scheduler_last_epoch"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
    except Exception as exc:  # noqa: BLE001
        state["optimizer_error"] = repr(exc)
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint):
            state["mc"] = {"_last_global_step_saved": cb._last_global_step_saved,
                           "_last_checkpoint_saved": os.path.basename(cb._last_checkpoint_saved),
                           "_defer_save_until_validation": getattr(cb, "_defer_save_until_validation", None),
                           "best_k": sorted(os.path.basename(k) for k in cb.best_k_models),
                           "last_model_path": os.path.basename(cb.last_model_path)}
        elif isinstance(cb, LearningRateMonitor):
            state["lrmon_points"] = sum(len(v) for v in cb.lrs.values())
        elif type(cb).__name__ == "SaveConfigCallback":
            state["save_config_already_saved"] = cb.already_saved
    state["callback_metrics"] = sorted(trainer.callback_metrics)
    state["loggers"] = [(type(lg).__name__, lg._version, getattr(lg, "_experiment", None) is not None)
                        for lg in trainer.loggers]
    acc = getattr(pl_module, "val_acc", None)
    if acc is not None:
        state["val_acc_state_samples"] = int(acc.tp.sum() + acc.fn.sum())
    state["val_samples_at_end"] = list(getattr(pl_module, "val_samples_at_end", []))
    return state


# ----------------------------------------------------------------------------- results


def weights_digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def write_result(trainer: pl.Trainer, model: pl.LightningModule) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)
    result = {
        "pid": os.getpid(), "rank": trainer.global_rank, "trained": bool(getattr(trainer.strategy, "trained", True)),
        "step": trainer.global_step, "epoch": trainer.current_epoch, "weights": weights_digest(model),
        "recoveries": getattr(trainer.strategy, "recoveries", 0), "t": time.time(),
        "log_dir": trainer.log_dir if trainer.loggers else None,
        "loggers": [{"type": type(lg).__name__, "version": lg.version} for lg in trainer.loggers],
        "best_k": {os.path.basename(k): float(v) for k, v in ckpt.best_k_models.items()} if ckpt else None,
        "best_model_path": ckpt.best_model_path if ckpt else None,
        "last_model_path": ckpt.last_model_path if ckpt else None,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "val_samples_at_end": list(getattr(model, "val_samples_at_end", [])),
        "status": str(trainer.state.status),
    }
    (knobs().out / f"result-{os.getpid()}.json").write_text(json.dumps(result, indent=1))


# ----------------------------------------------------------------------------- the script


def build_callbacks(ckpt_dir: str | None, deadlock_at: int | None = None) -> list[pl.Callback]:
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=25, save_last=True, monitor="val_acc", mode="max",
                        save_top_k=2),
        LearningRateMonitor(logging_interval="step"),
        Probe(),
    ]
    if deadlock_at is not None:
        callbacks.append(DeadlockAt(deadlock_at))
    return callbacks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results/progress directory")
    p.add_argument("--root", required=True, help="default_root_dir: logs and checkpoints (shared by all nodes)")
    p.add_argument("--strategy", default="ddp_ft", choices=["ddp_ft", "ddp", "auto"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data", default="plain", choices=["plain", "resumable"])
    p.add_argument("--dropout", type=float, default=0.0, help="a Dropout layer with this probability")
    p.add_argument("--tensorboard", action="store_true", help="add a TensorBoardLogger after the CSVLogger")
    p.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint dirpath (default: under the logger's version)")
    p.add_argument("--ckpt-path", default=None, help="fit(ckpt_path=...), e.g. mem://120 (needs MemoryCheckpointIO)")
    p.add_argument("--snapshot-every", type=int, default=None, help="ddp_ft snapshot_every_n_steps (default: 30 s)")
    p.add_argument("--hang-floor", type=float, default=None, help="ddp_ft hang_timeout_floor (default 60)")
    p.add_argument("--pg-timeout", type=float, default=None, help="process-group timeout seconds (default 30 min)")
    p.add_argument("--ft-option", action="append", default=[], metavar="KEY=JSON")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--val-sleep", type=float, default=0.0)
    p.add_argument("--save-sleep", type=float, default=0.0)
    p.add_argument("--setup-sleep", type=float, default=0.0)
    p.add_argument("--sleep-from-step", type=int, default=0)
    p.add_argument("--sleep-until-step", type=int, default=None)
    p.add_argument("--deadlock-at-step", type=int, default=None, help="ranks 0 and 1 wait for each other here")
    args = p.parse_args(argv)

    global KNOBS
    KNOBS = Knobs(args.out, args.step_sleep, args.val_sleep, args.save_sleep, args.setup_sleep,
                  args.sleep_from_step, args.sleep_until_step)

    import datetime

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    plugins = []
    if args.strategy == "ddp_ft":
        import lightning_ft

        options: dict[str, Any] = {}
        if args.snapshot_every is not None:
            options["snapshot_every_n_steps"] = args.snapshot_every
        if args.hang_floor is not None:
            options["hang_timeout_floor"] = args.hang_floor
        if args.pg_timeout is not None:
            options["timeout"] = datetime.timedelta(seconds=args.pg_timeout)
        for item in args.ft_option:
            key, _, raw = item.partition("=")
            options[key] = json.loads(raw)
        strategy: Any = lightning_ft.FaultTolerantDDPStrategy(**options) if options else "ddp_ft"
    elif args.strategy == "ddp":
        strategy = pl.strategies.DDPStrategy(
            timeout=datetime.timedelta(seconds=args.pg_timeout) if args.pg_timeout else
            pl.strategies.ddp.default_pg_timeout)
    else:
        strategy = "auto"
    if args.ckpt_path and args.ckpt_path.startswith("mem://"):
        from lightning_ft.checkpoint import MemoryCheckpointIO

        plugins.append(MemoryCheckpointIO())

    pl.seed_everything(args.seed, workers=True)
    model = UserModel(total_steps=args.max_steps, dropout=args.dropout)
    data = UserDataModule(loader=args.data)
    loggers: list[Any] = [CSVLogger(args.root, name="lightning_logs")]
    if args.tensorboard:
        loggers.append(TensorBoardLogger(args.root, name="tb_logs"))
    trainer = pl.Trainer(
        default_root_dir=args.root, accelerator="cpu", devices=args.devices, strategy=strategy, plugins=plugins,
        max_steps=args.max_steps, max_epochs=-1, val_check_interval=50, check_val_every_n_epoch=None,
        accumulate_grad_batches=2, gradient_clip_val=1.0, log_every_n_steps=5, logger=loggers,
        callbacks=build_callbacks(args.ckpt_dir, args.deadlock_at_step), enable_progress_bar=False,
        deterministic=True,
    )
    try:
        trainer.fit(model, datamodule=data, ckpt_path=args.ckpt_path)
    except SystemExit as exc:
        (KNOBS.out / f"exit-{os.getpid()}").write_text(str(exc.code))
        raise
    progress(trainer, "fit_end")
    write_result(trainer, model)
    if args.strategy == "ddp":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

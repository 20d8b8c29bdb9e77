"""Training script for the SIGTERM-path tests (single process, torchrun, or Lightning's popen ``ddp``).

Writes into ``--out``:
  ready.rank{R}   "pid step" once global_step >= --ready-step (the test signals after that)
  start.rank{R}   JSON {"step", "digest"} of the state fit() starts from (after any resume)
  stop.rank{R}    JSON {"step", "digest", "code"} when GracefulTermination stops the run
  exit.rank{R}    exit code, for exits through SystemExit (not for os._exit)
  done.rank{R}    JSON {"step", "digest"} when fit() returns normally
The digest covers weights and optimizer state, so a resume can be compared with the stop.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch


def rank_from_env() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def digest(module: torch.nn.Module, optimizers: list) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    for optimizer in optimizers:
        state = optimizer.state_dict()
        for key in sorted(state["state"]):
            for field, value in sorted(state["state"][key].items()):
                h.update(f"{key}.{field}".encode())
                h.update(value.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(value)
                         else repr(value).encode())
        h.update(repr([{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]).encode())
    return h.hexdigest()[:16]


def collective_bound_ddp(collective_seconds: float):
    """DDP whose collectives are bounded by ``collective_seconds`` while forming the group may take
    longer: Lightning's ``timeout`` bounds both, and the popen launcher's child rank is a fresh
    interpreter whose imports can outlast a short collective bound on a loaded machine (seen in CI)."""
    import lightning.pytorch as pl
    from torch.distributed.distributed_c10d import _set_pg_timeout

    class CollectiveBoundDDP(pl.strategies.DDPStrategy):
        def setup_distributed(self) -> None:
            super().setup_distributed()
            _set_pg_timeout(datetime.timedelta(seconds=collective_seconds))

    return CollectiveBoundDDP(timeout=datetime.timedelta(seconds=max(collective_seconds, 180.0)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--ready-step", type=int, default=3)
    parser.add_argument("--step-sleep", type=float, default=0.03)
    parser.add_argument("--snapshot-dir", default=None)
    parser.add_argument("--run-id", default="graceful-test")
    parser.add_argument("--no-emergency", action="store_true")
    parser.add_argument("--snapshot-every", type=int, default=None)
    parser.add_argument("--unhealthy-marker-dir", default=None,
                        help="probe = marker file <dir>/unhealthy.rank<R> (only that rank sees it)")
    parser.add_argument("--hang-probe", action="store_true", help="add a probe that never answers")
    parser.add_argument("--health-timeout", type=float, default=None)
    parser.add_argument("--overrun-healthy", action="store_true")
    parser.add_argument("--grace", type=float, default=None)
    parser.add_argument("--pg-timeout", type=float, default=30.0)
    parser.add_argument("--self-signal-step", type=int, default=None, help="SIGTERM to itself at this step")
    parser.add_argument("--exit-dir", default=None, help="GracefulTermination(exit_record_dir=...)")
    parser.add_argument("--csv-logs", default=None, help="a CSVLogger here; the loss logged every step")
    args = parser.parse_args()

    rank = rank_from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[%(asctime)s r{rank} %(name)s %(levelname)s] %(message)s")
    for noisy in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ft import EmergencyCheckpoint, GracefulTermination
    from lightning_ft.exit_codes import FaultTolerantExit
    from lightning_ft.health import CommandProbe, MarkerFileProbe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            time.sleep(args.step_sleep)  # a fixed step time, so signals land mid-run
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            if args.csv_logs:
                self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1234)
            x = torch.randn(64, 8, generator=g)
            return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4, shuffle=True)

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.ready_written = False

        def _write(self, name: str, data: dict, trainer: pl.Trainer) -> None:
            path = out / f"{name}.rank{trainer.global_rank}"
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)

        def on_train_start(self, trainer, pl_module):
            self._write("start", {"step": trainer.global_step, "digest": digest(pl_module, trainer.optimizers)},
                        trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not self.ready_written and trainer.global_step >= args.ready_step:
                self.ready_written = True
                self._write("ready", {"pid": os.getpid(), "step": trainer.global_step}, trainer)
            if args.self_signal_step is not None and trainer.global_step == args.self_signal_step:
                os.kill(os.getpid(), signal.SIGTERM)

        def on_exception(self, trainer, pl_module, exception):
            code = exception.code if isinstance(exception, FaultTolerantExit) else None
            self._write("stop", {"step": trainer.global_step, "code": code, "exception": type(exception).__name__,
                                 "digest": digest(pl_module, trainer.optimizers)}, trainer)

        def on_train_end(self, trainer, pl_module):
            self._write("done", {"step": trainer.global_step, "digest": digest(pl_module, trainer.optimizers)},
                        trainer)

    probes = None
    if args.unhealthy_marker_dir or args.hang_probe:
        probes = []
        if args.unhealthy_marker_dir:
            probes.append(MarkerFileProbe(Path(args.unhealthy_marker_dir) / f"unhealthy.rank{rank}"))
        if args.hang_probe:
            probes.append(CommandProbe([sys.executable, "-c", "import time; time.sleep(60)"], name="hangs"))
    termination = GracefulTermination(probes=probes, health_timeout=args.health_timeout,
                                      overrun_is_unhealthy=not args.overrun_healthy, grace_seconds=args.grace,
                                      exit_record_dir=args.exit_dir)
    callbacks: list[pl.Callback] = [Recorder(), termination]
    if not args.no_emergency:
        callbacks.append(EmergencyCheckpoint(every_n_steps=args.snapshot_every, root=args.snapshot_dir,
                                             run_id=args.run_id))

    strategy = args.strategy
    if strategy == "ddp":
        strategy = collective_bound_ddp(args.pg_timeout)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
                         max_epochs=-1, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=pl.loggers.CSVLogger(args.csv_logs) if args.csv_logs else False,
                         enable_checkpointing=False, num_sanity_val_steps=0, callbacks=callbacks)
    try:
        trainer.fit(TinyModule())
    except SystemExit as exc:
        (out / f"exit.rank{trainer.global_rank}").write_text(str(exc.code))
        raise
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

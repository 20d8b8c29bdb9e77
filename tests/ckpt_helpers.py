"""Shared pieces for the checkpoint tests; also run as a script by the multi-process tests.

    python tests/ckpt_helpers.py write-big ROOT RUN_ID      # commit step 1, then write a big step 2
    torchrun ... tests/ckpt_helpers.py ddp ROOT RUN_ID MAX_STEPS MODE RESULT_DIR   # MODE: auto | mem
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def tensors_equal(a: Any, b: Any) -> bool:
    """Deep equality of nested checkpoint structures (tensors by value, dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def make_module(seed: int = 0, hidden: int = 16):
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1234)
            x = torch.randn(20, 8, generator=g)
            y = x.sum(dim=1, keepdim=True)
            return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)  # 5 steps per epoch

    return TinyModule()


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    kw.update(overrides)
    return kw


def resume_probe():
    """Callback recording the state right after the restore (at on_train_start)."""
    import copy

    import lightning.pytorch as pl

    class ResumeProbe(pl.Callback):
        def __init__(self) -> None:
            self.start_step: int | None = None
            self.start_state: dict[str, Any] = {}

        def on_train_start(self, trainer, pl_module):
            self.start_step = trainer.global_step
            self.start_state = copy.deepcopy({
                "state_dict": pl_module.state_dict(),
                "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],
                "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
                "fit_loop": trainer.fit_loop.state_dict(),
            })

    return ResumeProbe()


def matches_snapshot(probe, snapshot: dict[str, Any]) -> bool:
    return (probe.start_step == snapshot["global_step"]
            and tensors_equal(probe.start_state["state_dict"], snapshot["state_dict"])
            and tensors_equal(probe.start_state["optimizer_states"], snapshot["optimizer_states"])
            and tensors_equal(probe.start_state["lr_schedulers"], snapshot["lr_schedulers"]))


# --------------------------------------------------------------------------- scripts
def _write_big(root: str, run_id: str) -> None:
    from lightning_ft.checkpoint import SnapshotStore

    store = SnapshotStore(root=root, run_id=run_id, rank=0, keep_last=2)
    store.save({"w": torch.ones(16)}, step=1)
    big = {f"t{i}": torch.full((2 << 20,), float(i)) for i in range(48)}  # 48 x 8 MiB
    print("committed 1", flush=True)
    store.save(big, step=2)
    print("committed 2", flush=True)


def _ddp(root: str, run_id: str, max_steps: int, mode: str, result_dir: str) -> None:
    import datetime
    import logging

    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ft import EmergencyCheckpoint
    from lightning_ft.checkpoint import MemoryCheckpointIO, SnapshotStore

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rank = int(os.environ["RANK"])
    probe = resume_probe()
    callback = EmergencyCheckpoint(every_n_steps=4, root=root, run_id=run_id, auto_resume=(mode == "auto"))
    plugins = [MemoryCheckpointIO(root=root, run_id=run_id)] if mode == "mem" else []
    trainer = pl.Trainer(**trainer_kwargs(
        devices=2, max_steps=max_steps, callbacks=[callback, probe], plugins=plugins,
        strategy=DDPStrategy(timeout=datetime.timedelta(seconds=20))))
    try:
        trainer.fit(make_module(seed=100 + rank), ckpt_path="mem://latest" if mode == "mem" else None)
        matched = None
        if probe.start_step:
            store = SnapshotStore(root=root, run_id=run_id, rank=rank)
            info = store.find(probe.start_step, include_peers=True)
            matched = matches_snapshot(probe, store.load(info))
        steps = [i.step for i in SnapshotStore(root=root, run_id=run_id, rank=rank).list()]
        result = {"rank": rank, "start_step": probe.start_step, "end_step": trainer.global_step,
                  "matched": matched, "snapshots": steps}
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        # Lightning never destroys a gloo group; without this ~1/15 runs abort at exit
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "write-big":
        _write_big(*args)
    elif cmd == "ddp":
        _ddp(args[0], args[1], int(args[2]), args[3], args[4])
    else:
        raise SystemExit(f"unknown command {cmd}")

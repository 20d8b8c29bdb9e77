"""Lightning's ModelParallelStrategy (FSDP2, CPU/gloo, 2 processes) with EmergencyCheckpoint:
each rank snapshots its own shards; a new launch with the same run id resumes from them.

``python model_parallel_resume.py --root DIR --run-id ID --max-steps N --out FILE``: rank 0 writes
JSON: the step reached, the step resumed from (None: fresh) and a digest of the full weights."""

from __future__ import annotations

import argparse
import hashlib
import json

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_ft.checkpoint import EmergencyCheckpoint


class Sharded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Report(pl.Callback):
    def __init__(self, out: str, checkpoint: EmergencyCheckpoint) -> None:
        self.out = out
        self.checkpoint = checkpoint

    def on_train_end(self, trainer, pl_module) -> None:
        full = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True))
        if trainer.global_rank == 0:
            digest = hashlib.sha256()
            for key in sorted(full):
                digest.update(key.encode())
                digest.update(full[key].numpy().tobytes())
            resumed = self.checkpoint.resumed_from
            with open(self.out, "w") as f:
                json.dump({"step": trainer.global_step, "resumed": resumed[0] if resumed else None,
                           "digest": digest.hexdigest()}, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 4))  # 4 steps per epoch: snapshots at epoch ends
    checkpoint = EmergencyCheckpoint(every_n_steps=4, root=args.root, run_id=args.run_id)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2,
                                                                                      tensor_parallel_size=1),
                         max_steps=args.max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[checkpoint, Report(args.out, checkpoint)])
    trainer.fit(Sharded(), DataLoader(data, batch_size=8, shuffle=False))
    # Lightning leaves the default group to interpreter exit; torch's gloo threads then sometimes
    # meet static destruction still joinable ("terminate called without an active exception",
    # seen once in a suite run, in a process that had finished). Ended here, as torch advises.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

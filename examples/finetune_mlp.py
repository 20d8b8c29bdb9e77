"""Fine-tune a pretrained MLP on a small tabular dataset, fault-tolerantly (CPU, well under a minute).

The story: a "source" domain has plenty of labelled rows; the "target" domain has few,
with shifted feature distributions and a related but different labelling rule. We
pretrain an MLP on the source (plain PyTorch, a few seconds, deterministic), then
fine-tune it on the target with Lightning: a fresh classification head, a 10x lower
learning rate for the pretrained body, warmup + cosine decay (about 0.87 validation
accuracy with the defaults, 0.82 without pretraining). The data is synthetic and
generated from ``--seed`` (no downloads, no scikit-learn).

    python examples/finetune_mlp.py                        # one process
    python examples/finetune_mlp.py --strategy ddp --devices 2
    python examples/finetune_mlp.py --strategy ddp_ft      # one participant; see examples/demo.py
    python examples/finetune_mlp.py --strategy fsdp_ft     # the same, every layer sharded (FSDP2)

Send SIGTERM mid-run: the run stops at an agreed step, snapshots to shared memory and
exits 81; the same command again resumes at that step and ends with the same weights
as an uninterrupted run (compare the ``weights=`` digest of the FINAL line).
"""

from __future__ import annotations

import argparse
import math
import sys

import common

EXAMPLE = "finetune_mlp"
NUM_NUMERIC = 12
NUM_CATEGORIES = 4  # one categorical feature, one-hot encoded
NUM_FEATURES = NUM_NUMERIC + NUM_CATEGORIES
NUM_CLASSES = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="finetune_mlp.py", description=__doc__.split("\n\n")[0])
    common.add_training_args(parser, max_steps=300, batch_size=32, lr=3e-3)
    model = parser.add_argument_group("model and data")
    model.add_argument("--hidden", type=common.positive_int, default=64, help="hidden width (default 64)")
    model.add_argument("--pretrain-steps", type=common.non_negative_int, default=300,
                       help="steps of source-domain pretraining, 0 = fine-tune from random weights (default 300)")
    model.add_argument("--target-rows", type=common.positive_int, default=512,
                       help="labelled target rows to fine-tune on (default 512)")
    args = parser.parse_args(argv)
    common.check_args(parser, args)
    if args.batch_size > args.target_rows:
        parser.error(f"--batch-size {args.batch_size} is larger than --target-rows {args.target_rows}")
    return args


# ---------------------------------------------------------------------- data

def make_domain(rows: int, seed: int, *, shift: float, rule_seed: int, rule_mix: float):
    """Rows of (features, label) for one domain.

    Labels come from a fixed random "teacher" network over the features; ``rule_mix``
    blends in a second teacher, so the target's rule is related to the source's but not
    equal to it. ``shift`` moves and rescales the numeric features.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    numeric = torch.randn(rows, NUM_NUMERIC, generator=g) * (1 + shift) + shift
    category = torch.randint(0, NUM_CATEGORIES, (rows,), generator=g)
    x = torch.cat([numeric, torch.nn.functional.one_hot(category, NUM_CATEGORIES).float()], dim=1)

    def teacher(s: int):
        tg = torch.Generator().manual_seed(s)
        w1 = torch.randn(NUM_FEATURES, 32, generator=tg) / math.sqrt(NUM_FEATURES)
        w2 = torch.randn(32, NUM_CLASSES, generator=tg)
        return lambda inputs: torch.tanh(inputs @ w1) @ w2

    logits = (1 - rule_mix) * teacher(rule_seed)(x) + rule_mix * teacher(rule_seed + 1)(x)
    noisy = logits + 0.3 * torch.randn(logits.shape, generator=g)  # some label noise: not perfectly learnable
    return torch.utils.data.TensorDataset(x, noisy.argmax(dim=1))


def source_data(seed: int):
    return make_domain(8192, seed * 1000 + 1, shift=0.0, rule_seed=seed * 1000 + 7, rule_mix=0.0)


def target_data(seed: int, rows: int):
    """(train, validation) of the target domain."""
    data = make_domain(rows + 2048, seed * 1000 + 2, shift=0.5, rule_seed=seed * 1000 + 7, rule_mix=0.2)
    x, y = data.tensors
    import torch

    return (torch.utils.data.TensorDataset(x[:rows], y[:rows]),
            torch.utils.data.TensorDataset(x[rows:], y[rows:]))


# ---------------------------------------------------------------------- model

def make_body(hidden: int):
    from torch import nn

    return nn.Sequential(nn.Linear(NUM_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())


def pretrain_body(hidden: int, steps: int, seed: int):
    """Source-domain pretraining in plain PyTorch; deterministic for a seed, so every process agrees."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    body = make_body(hidden)
    if steps == 0:
        return body
    head = nn.Linear(hidden, NUM_CLASSES)
    x, y = source_data(seed).tensors
    optimizer = torch.optim.Adam([*body.parameters(), *head.parameters()], lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (256,), generator=g)
        loss = nn.functional.cross_entropy(head(body(x[idx])), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return body


def make_module(args: argparse.Namespace, body, train_set):
    import lightning.pytorch as pl
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchmetrics.classification import MulticlassAccuracy

    class TabularFineTuner(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = body
            self.head = nn.Linear(args.hidden, NUM_CLASSES)
            self.train_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")

        def forward(self, x):
            return self.head(self.body(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = nn.functional.cross_entropy(logits, y)
            self.train_acc(logits, y)
            self.log("loss", loss, on_step=True, on_epoch=False)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
            return loss

        def configure_model(self):
            # fsdp_ft (as Lightning's ModelParallelStrategy): shard every layer over the data-parallel
            # ranks; configure_model runs in every fit(), so only once
            if args.strategy != "fsdp_ft" or isinstance(self.head, FSDPModule):
                return
            for layer in [*self.body, self.head]:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])

        def configure_optimizers(self):
            # discriminative learning rates: the pretrained body moves slowly, the new head fast
            return common.finetune_optimizers(self.body, self.head, args)

        def train_dataloader(self):
            return common.stateful_loader(train_set, args.batch_size, args.seed, self.trainer)

    return TabularFineTuner()


def evaluate(model, dataset) -> dict[str, float]:
    """Accuracy and macro F1 on the held-out target rows (torchmetrics)."""
    x, y = dataset.tensors
    return common.evaluate_classifier(model, x, y, NUM_CLASSES)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.quiet_logs(args.verbose)
    import lightning.pytorch as pl

    pl.seed_everything(args.seed, workers=True, verbose=False)
    run_id = args.run_id or common.default_run_id(EXAMPLE)
    train_set, val_set = target_data(args.seed, args.target_rows)
    body = common.pretrained_module(args.pretrained, lambda: pretrain_body(args.hidden, args.pretrain_steps, args.seed),
                                    lambda: make_body(args.hidden))
    model = make_module(args, body, train_set)
    sharded = common.final_of_sharded(lambda: evaluate(model, val_set))
    trainer = common.build_trainer(args, run_id, [sharded])
    trainer.fit(model)
    return common.finish(EXAMPLE, trainer, model, lambda: evaluate(model, val_set), args, run_id, sharded)


if __name__ == "__main__":
    sys.exit(main())

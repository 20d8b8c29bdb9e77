"""Pretrain a tiny transformer, then fine-tune it as a sequence classifier, fault-tolerantly (CPU, < 1 min).

The data: token sequences from four "sources", each a Markov chain over a small
vocabulary (a shared base chain plus a source-specific part, so the sources overlap).
Pretraining (plain PyTorch, a few seconds, deterministic for a seed) is next-token
prediction on unlabelled sequences from all sources: to predict well, the causal
encoder has to work out from the context which source it is reading. Fine-tuning
(Lightning) then learns to name the source from a few hundred labelled sequences: a
fresh classification head on the mean-pooled encoder output, the encoder at a 10x
lower learning rate, warmup + cosine decay. With the defaults the pretrained encoder
reaches about 0.86 validation accuracy, one fine-tuned from random weights
(``--pretrain-steps 0``) about 0.67. Everything is generated from ``--seed``; nothing is downloaded.

    python examples/finetune_transformer.py                        # one process
    python examples/finetune_transformer.py --strategy ddp --devices 2
    python examples/finetune_transformer.py --strategy ddp_ft      # one participant; see examples/demo.py

Send SIGTERM mid-run: the run stops at an agreed step, snapshots to shared memory and
exits 81; the same command again resumes at that step and ends with the same weights
as an uninterrupted run (compare the ``weights=`` digest of the FINAL line).
"""

from __future__ import annotations

import argparse
import sys

import common

EXAMPLE = "finetune_transformer"
VOCAB = 16
NUM_SOURCES = 4  # = classes of the fine-tuning task
SHARED = 0.3  # weight of the chain all sources share


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="finetune_transformer.py", description=__doc__.split("\n\n")[0])
    common.add_training_args(parser, max_steps=200, batch_size=32, lr=3e-3)
    model = parser.add_argument_group("model and data")
    model.add_argument("--seq-len", type=common.positive_int, default=24, help="tokens per sequence (default 24)")
    model.add_argument("--d-model", type=common.positive_int, default=32,
                       help="embedding width, a multiple of --heads (default 32)")
    model.add_argument("--heads", type=common.positive_int, default=4, help="attention heads (default 4)")
    model.add_argument("--layers", type=common.positive_int, default=2, help="encoder layers (default 2)")
    model.add_argument("--pretrain-steps", type=common.non_negative_int, default=500,
                       help="next-token pretraining steps, 0 = fine-tune from random weights (default 500)")
    model.add_argument("--labelled", type=common.positive_int, default=256,
                       help="labelled sequences to fine-tune on (default 256)")
    args = parser.parse_args(argv)
    common.check_args(parser, args)
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.seq_len < 2:
        parser.error(f"--seq-len must be at least 2, got {args.seq_len}")
    if args.batch_size > args.labelled:
        parser.error(f"--batch-size {args.batch_size} is larger than --labelled {args.labelled}")
    return args


# ---------------------------------------------------------------------- data

def transition_matrices(seed: int):
    """One row-stochastic matrix per source: a shared chain (weight SHARED) plus the source's own."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + 11)

    def sparse_chain():
        # each token has a few likely successors: structure a model can learn
        logits = torch.randn(VOCAB, VOCAB, generator=g) * 2.5
        return torch.softmax(logits, dim=1)

    base = sparse_chain()
    return torch.stack([SHARED * base + (1 - SHARED) * sparse_chain() for _ in range(NUM_SOURCES)])


def sample_sequences(count: int, seq_len: int, seed: int, data_seed: int):
    """(tokens [count, seq_len], source label [count]) drawn from the sources' chains."""
    import torch

    chains = transition_matrices(seed)
    g = torch.Generator().manual_seed(data_seed)
    labels = torch.randint(0, NUM_SOURCES, (count,), generator=g)
    tokens = torch.empty(count, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (count,), generator=g)
    for t in range(1, seq_len):
        probs = chains[labels, tokens[:, t - 1]]
        tokens[:, t] = torch.multinomial(probs, 1, generator=g).squeeze(1)
    return tokens, labels


def labelled_data(args: argparse.Namespace):
    """(train, validation) TensorDatasets of the fine-tuning task."""
    import torch

    x, y = sample_sequences(args.labelled + 2048, args.seq_len, args.seed, data_seed=args.seed * 1000 + 2)
    n = args.labelled
    return torch.utils.data.TensorDataset(x[:n], y[:n]), torch.utils.data.TensorDataset(x[n:], y[n:])


# ---------------------------------------------------------------------- model

def make_encoder(args: argparse.Namespace):
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, args.d_model)
            self.positions = nn.Parameter(torch.randn(args.seq_len, args.d_model) * 0.02)
            # dropout 0: training is then a pure function of the state, so a resumed run is
            # bit-identical to an uninterrupted one (dropout would need the RNG state saved too)
            layer = nn.TransformerEncoderLayer(args.d_model, args.heads, dim_feedforward=2 * args.d_model,
                                               dropout=0.0, batch_first=True, norm_first=True)
            self.layers = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(args.d_model)

        def forward(self, tokens):
            # causal in pretraining and fine-tuning alike, so the representation keeps its meaning. Built
            # per call rather than kept as a buffer: DDP would broadcast a buffer before every step.
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
            return self.norm(self.layers(self.tokens(tokens) + self.positions, mask=mask, is_causal=True))

    return Encoder()


def pretrain_encoder(args: argparse.Namespace):
    """Next-token prediction on unlabelled sequences (plain PyTorch; deterministic for a seed)."""
    import torch
    from torch import nn

    torch.manual_seed(args.seed)
    encoder = make_encoder(args)
    if args.pretrain_steps == 0:
        return encoder
    predict = nn.Linear(args.d_model, VOCAB)
    tokens, _ = sample_sequences(4096, args.seq_len, args.seed, data_seed=args.seed * 1000 + 1)
    optimizer = torch.optim.Adam([*encoder.parameters(), *predict.parameters()], lr=3e-3)
    g = torch.Generator().manual_seed(args.seed)
    for _ in range(args.pretrain_steps):
        batch = tokens[torch.randint(0, len(tokens), (64,), generator=g)]
        logits = predict(encoder(batch))[:, :-1]  # position t predicts token t+1
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return encoder


def make_module(args: argparse.Namespace, encoder, train_set):
    import lightning.pytorch as pl
    from torch import nn
    from torchmetrics.classification import MulticlassAccuracy

    class SequenceClassifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder
            self.head = nn.Linear(args.d_model, NUM_SOURCES)
            self.train_acc = MulticlassAccuracy(num_classes=NUM_SOURCES, average="micro")

        def forward(self, tokens):
            return self.head(self.encoder(tokens).mean(dim=1))

        def training_step(self, batch, batch_idx):
            tokens, labels = batch
            logits = self(tokens)
            loss = nn.functional.cross_entropy(logits, labels)
            self.train_acc(logits, labels)
            self.log("loss", loss, on_step=True, on_epoch=False)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return common.finetune_optimizers(self.encoder, self.head, args)  # pretrained encoder moves slowly

        def train_dataloader(self):
            return common.stateful_loader(train_set, args.batch_size, args.seed, self.trainer)

    return SequenceClassifier()


def evaluate(model, dataset) -> dict[str, float]:
    """Accuracy and macro F1 on held-out labelled sequences (torchmetrics)."""
    tokens, labels = dataset.tensors
    return common.evaluate_classifier(model, tokens, labels, NUM_SOURCES, chunk=512)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.quiet_logs(args.verbose)
    import lightning.pytorch as pl

    pl.seed_everything(args.seed, workers=True, verbose=False)
    run_id = args.run_id or common.default_run_id(EXAMPLE)
    train_set, val_set = labelled_data(args)
    encoder = common.pretrained_module(args.pretrained, lambda: pretrain_encoder(args), lambda: make_encoder(args))
    model = make_module(args, encoder, train_set)
    trainer = common.build_trainer(args, run_id)
    trainer.fit(model)
    return common.finish(EXAMPLE, trainer, model, lambda: evaluate(model, val_set), args, run_id)


if __name__ == "__main__":
    sys.exit(main())

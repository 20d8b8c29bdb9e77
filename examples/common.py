"""Plumbing shared by the fine-tuning examples: arguments, Trainer and callbacks, the final line.

The examples import this as ``common`` (Python puts the script's directory on ``sys.path``).
Only the model and the data differ between examples; everything fault-tolerance related
is here, so it reads the same way in both:

* ``EmergencyCheckpoint`` snapshots the full training state (weights, optimizer, LR
  scheduler, loop counters, and the ``StatefulDataLoader`` position) into host shared
  memory -- by default as often as keeps the measured save within 0.5 % of training time,
  or every ``--snapshot-every`` steps -- and resumes from the newest snapshot on start;
* ``GracefulTermination`` turns SIGTERM into a snapshot at an agreed step and exit 81
  ("requeue me"); running the same command again continues from that step;
* ``--strategy ddp_ft`` runs the fault-tolerant strategy, configured from the
  ``LIGHTNING_FT_*`` environment (see ``examples/demo.py``); ``--strategy fsdp_ft`` the same
  with sharded state (the model shards its layers with FSDP2 in ``configure_model``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

STRATEGIES = ("auto", "ddp", "ddp_ft", "fsdp_ft")
#: the lightning_ft strategies: one process per participant, configured by LIGHTNING_FT_* variables
FT_STRATEGIES = ("ddp_ft", "fsdp_ft")
FINAL_LINE_PREFIX = "FINAL"  # tests and the demo look for this word at the start of a line
#: without --snapshot-every: snapshots within this share of training time (the ddp_ft strategy's default)
SNAPSHOT_OVERHEAD = 0.005


def warmup_cosine(total_steps: int, warmup_steps: int):
    """LambdaLR factor: linear warm-up, then cosine decay to zero at ``total_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def finetune_optimizers(pretrained, head, args) -> dict:
    """AdamW with discriminative learning rates plus warm-up/cosine, for ``configure_optimizers``.

    The pretrained part moves slowly (lr / 10), the new head fast (lr).
    """
    import torch

    optimizer = torch.optim.AdamW([
        {"params": pretrained.parameters(), "lr": args.lr / 10},
        {"params": head.parameters(), "lr": args.lr},
    ], weight_decay=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(args.max_steps, warmup_steps=max(1, args.max_steps // 10)))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def evaluate_classifier(model, inputs, labels, num_classes: int, chunk: int | None = None) -> dict[str, float]:
    """Accuracy and macro F1 (torchmetrics) of ``model`` on a held-out set, ``chunk`` rows at a time."""
    import torch
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

    # sync_on_compute=False: only rank 0 evaluates, on the whole set; no collective with peers
    metrics = MetricCollection({
        "val_accuracy": MulticlassAccuracy(num_classes=num_classes, average="micro", sync_on_compute=False),
        "val_macro_f1": MulticlassF1Score(num_classes=num_classes, average="macro", sync_on_compute=False),
    })
    chunk = chunk or len(inputs)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(inputs), chunk):
            metrics.update(model(inputs[start:start + chunk]), labels[start:start + chunk])
    return {name: float(value) for name, value in metrics.compute().items()}


# ---------------------------------------------------------------------- arguments

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def add_training_args(parser: argparse.ArgumentParser, *, max_steps: int, batch_size: int, lr: float) -> None:
    """The arguments every example shares (defaults per example)."""
    train = parser.add_argument_group("training")
    train.add_argument("--max-steps", type=positive_int, default=max_steps,
                       help=f"optimizer steps of fine-tuning (default {max_steps})")
    train.add_argument("--max-epochs", type=positive_int, default=None,
                       help="stop after this many epochs if that comes before --max-steps (default: no limit)")
    train.add_argument("--batch-size", type=positive_int, default=batch_size,
                       help=f"per-process batch size (default {batch_size})")
    train.add_argument("--lr", type=positive_float, default=lr, help=f"peak learning rate of the head (default {lr:g})")
    train.add_argument("--seed", type=non_negative_int, default=0,
                       help="seed for data, initialization and shuffling; same seed, same result (default 0)")
    train.add_argument("--pretrained", default=None, metavar="PATH",
                       help="load the pretrained part from PATH; the first process to need it pretrains and "
                            "writes it there, the others wait and load it (default: every process pretrains)")
    ft = parser.add_argument_group("distribution and fault tolerance")
    ft.add_argument("--strategy", choices=STRATEGIES, default="auto",
                    help="auto: one process; ddp: Lightning DDP with --devices local processes; ddp_ft: "
                         "fault-tolerant DDP, one process per participant, configured by LIGHTNING_FT_ENDPOINT, "
                         "LIGHTNING_FT_RUN_ID, LIGHTNING_FT_NNODES; fsdp_ft: the same with the model's layers "
                         "sharded (FSDP2) (default auto)")
    ft.add_argument("--devices", type=positive_int, default=1,
                    help="processes for --strategy ddp (default 1; ddp_ft always runs one per participant)")
    ft.add_argument("--snapshot-every", type=positive_int, default=None,
                    help="in-memory snapshot every N optimizer steps (default: as often as keeps the measured "
                         "save within 0.5 %% of training time, the first at step 8)")
    ft.add_argument("--snapshot-dir", default=None,
                    help="snapshot root (default $LIGHTNING_FT_SNAPSHOT_DIR or /dev/shm/lightning_ft)")
    ft.add_argument("--run-id", default=None,
                    help="snapshot scope; a rerun with the same id resumes (default $LIGHTNING_FT_RUN_ID, "
                         "$TORCHELASTIC_RUN_ID, $SLURM_JOB_ID, else the example's name)")
    ft.add_argument("--keep-snapshots", action="store_true",
                    help="keep this run's snapshots after it finished (default: free the shared memory)")
    out = parser.add_argument_group("output")
    out.add_argument("--progress-every", type=non_negative_int, default=25,
                     help="print a progress line every N steps, 0 = never (default 25)")
    out.add_argument("--step-delay", type=non_negative_float, default=0.0,
                     help="sleep this long after each step, to imitate a bigger model in demos (default 0)")
    out.add_argument("--verbose", action="store_true", help="show lightning_ft and Lightning info logs")


def pretrained_module(path: str | None, pretrain: Callable[[], Any], blank: Callable[[], Any]) -> Any:
    """The pretrained part of a model: ``pretrain()``, or with ``path`` its weights loaded from that
    file, which the first process to get there pretrains and writes (the others wait on a lock: one
    pretraining for all the processes on a machine, as a real job loads a downloaded checkpoint).

    The global random state after this is the same on either path, so the rest of the model is too.
    """
    import fcntl

    import torch

    with torch.random.fork_rng():
        if path is None:
            return pretrain()
        with open(path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(path):
                module = pretrain()
                torch.save(module.state_dict(), path + ".tmp")
                os.replace(path + ".tmp", path)  # whole or absent
                return module
        module = blank()
        module.load_state_dict(torch.load(path, weights_only=True))
        return module


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, environ=os.environ) -> None:
    """Checks that involve more than one argument or the environment; exits via ``parser.error``."""
    if args.devices > 1 and args.strategy != "ddp":
        parser.error(f"--devices {args.devices} needs --strategy ddp (with {args.strategy!r} each process is "
                     "one device)")
    if args.strategy in FT_STRATEGIES:
        # the strategy would raise the same error from inside the Trainer; say it before any work
        from lightning_ft.runtime.settings import StrategyConfigError, resolve_launch_config

        try:
            resolve_launch_config(None, None, None, None, env=environ)
        except StrategyConfigError as exc:
            parser.error(f"{exc} (examples/demo.py shows a complete setup)")
    if args.run_id is not None and not args.run_id.strip():
        parser.error("--run-id must not be empty")


def default_run_id(example: str, environ=os.environ) -> str:
    """The scheduler's job id when there is one (a requeued job resumes), else the example's name."""
    for key in ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if environ.get(key):
            return environ[key]
    return example


# ---------------------------------------------------------------------- setup

def quiet_logs(verbose: bool) -> None:
    """Keep the examples' output to our own lines unless --verbose (imports Lightning first, which
    sets up its own console logging that we then quieten)."""
    import lightning.pytorch  # noqa: F401

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="[%(asctime)s %(name)s %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    if verbose:
        logging.getLogger("lightning_ft").setLevel(logging.INFO)
        return
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_ft"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (".*does not have many workers.*", ".*enable_nested_tensor.*", ".*set_vital.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", message)


def stateful_loader(dataset: Any, batch_size: int, seed: int, trainer: Any):
    """A shuffling loader whose position is part of every snapshot, so a resume continues with
    exactly the batch that came next (checked by the tests: same final weights):
    :func:`lightning_ft.data.resumable_loader`."""
    from lightning_ft.data import resumable_loader

    return resumable_loader(dataset, batch_size, trainer, seed=seed)


def resumable_sampler(dataset: Any, world_size: int, rank: int, seed: int):
    """This rank's shard of a per-epoch shuffle that saves (epoch, position): see
    :class:`lightning_ft.data.ResumableShuffleSampler`."""
    from lightning_ft.data import ResumableShuffleSampler

    return ResumableShuffleSampler(dataset, world_size, rank, seed)


def build_trainer(args: argparse.Namespace, run_id: str, extra_callbacks: Sequence[Any] = ()):
    import lightning.pytorch as pl

    from lightning_ft import EmergencyCheckpoint, GracefulTermination

    callbacks = [
        EmergencyCheckpoint(every_n_steps=args.snapshot_every, root=args.snapshot_dir, run_id=run_id,
                            max_overhead=SNAPSHOT_OVERHEAD),
        GracefulTermination(),
        progress_printer(args.progress_every, args.step_delay, args.max_steps),
        *extra_callbacks,
    ]
    return pl.Trainer(
        accelerator="cpu", devices=args.devices if args.strategy == "ddp" else 1, strategy=args.strategy,
        max_steps=args.max_steps, max_epochs=args.max_epochs if args.max_epochs is not None else -1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, limit_val_batches=0, deterministic=True, callbacks=callbacks,
    )


def progress_printer(every_n_steps: int, step_delay: float, max_steps: int):
    """A callback that prints where training starts (fresh or resumed) and a progress line every N steps.

    Defined in a function so that ``--help`` and argument errors do not wait for the Lightning import.
    """
    import lightning.pytorch as pl

    class ProgressPrinter(pl.Callback):
        def __init__(self) -> None:
            self._clock: tuple[float, int] | None = None

        @staticmethod
        def _prefix(trainer) -> str:
            return f"[rank {trainer.global_rank}/{trainer.world_size}] " if trainer.world_size > 1 else ""

        def on_train_start(self, trainer, pl_module) -> None:
            step = trainer.global_step
            how = f"resumed from the snapshot of step {step}" if step else "starting at step 0"
            print(f"{self._prefix(trainer)}{how} (of {max_steps})", flush=True)
            self._clock = (time.perf_counter(), step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if step_delay:
                time.sleep(step_delay)
            step = trainer.global_step
            if not every_n_steps or step % every_n_steps or self._clock is None or step == self._clock[1]:
                return
            now = time.perf_counter()
            rate = (step - self._clock[1]) / max(now - self._clock[0], 1e-9)
            self._clock = (now, step)
            metrics = " ".join(f"{name} {float(value):.4f}" for name, value in sorted(trainer.callback_metrics.items()))
            print(f"{self._prefix(trainer)}step {step}/{max_steps}  {metrics}  ({rate:.1f} steps/s)", flush=True)

    return ProgressPrinter()


# ---------------------------------------------------------------------- the end of the run

def weights_digest(module) -> str:
    """Short hash of the weights: equal digests mean bit-identical models (checks exact resume).
    Sharded weights are gathered whole first (a collective: every rank calls it then)."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        h.update(name.encode())
        h.update(whole.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def final_of_sharded(evaluate: Callable[[], dict[str, float]]):
    """A callback that, with sharded state (``fsdp_ft``), evaluates and digests the model at the end
    of training on every rank -- the forward passes and the gathering of the weights are
    collectives, and the round's group is up only inside ``fit()`` -- for :func:`finish` to print."""
    import lightning.pytorch as pl

    class FinalOfSharded(pl.Callback):
        def __init__(self) -> None:
            self.result: tuple[dict[str, float], str] | None = None

        def on_train_end(self, trainer, pl_module) -> None:
            if isinstance(trainer.strategy, pl.strategies.ModelParallelStrategy):  # fsdp_ft
                self.result = (evaluate(), weights_digest(pl_module))

    return FinalOfSharded()


def format_final_line(example: str, step: int, metrics: dict[str, float], digest: str) -> str:
    values = " ".join(f"{name}={value:.4f}" for name, value in metrics.items())
    return f"{FINAL_LINE_PREFIX} {example} step={step} {values} weights={digest}"


def run_finished(trainer) -> bool:
    """fit() ran to its end (not stopped by a signal or an exception)."""
    from lightning.pytorch.trainer.states import TrainerStatus

    return trainer.state.status == TrainerStatus.FINISHED and not trainer.interrupted


def trained_here(trainer) -> bool:
    """False for a ddp_ft hot spare that fit() returned for without ever training (not needed)."""
    return bool(getattr(trainer.strategy, "trained", True))


def free_snapshots(trainer, root: str | None, run_id: str) -> None:
    """Delete this rank's snapshots of a finished run: they only serve a resume, and hold shared memory.

    Only this rank's: a peer sharing the root may still be committing the last step's snapshot.
    """
    from lightning_ft.checkpoint import SnapshotStore
    from lightning_ft.checkpoint.memory.roots import resolve_root

    with SnapshotStore(resolve_root(root), run_id, trainer.global_rank) as store:
        for info in store.list():
            store.delete(info)


def finish(example: str, trainer, model, evaluate: Callable[[], dict[str, float]], args, run_id: str,
           sharded: Any = None) -> int:
    """After fit(): the final metric line on rank 0, snapshot clean-up; returns the exit code.
    ``sharded``: the :func:`final_of_sharded` callback of this run (its result, when it has one)."""
    if not run_finished(trainer):
        print(f"{example}: training did not finish (status {trainer.state.status.value})", file=sys.stderr)
        return 1
    if not trained_here(trainer):
        print(f"{example}: hot spare, not needed by this run; exiting cleanly", flush=True)
        return 0
    if trainer.global_rank < 0:
        # ddp_ft: this process trained earlier, then waited as a spare while the others finished
        print(f"{example}: the run finished without this participant; exiting cleanly", flush=True)
        return 0
    if not args.keep_snapshots:
        free_snapshots(trainer, args.snapshot_dir, run_id)
    if trainer.global_rank == 0:
        metrics, digest = (sharded.result if sharded is not None and sharded.result is not None
                           else (evaluate(), weights_digest(model)))
        print(format_final_line(example, trainer.global_step, metrics, digest), flush=True)
    return 0

"""Tiny Lightning training run for the ``ddp_ft`` strategy tests and recovery benchmarks.

Same script for every mode:

* ``--strategy ddp_ft``: one process per participant; settings from LIGHTNING_FT_* variables,
  each process with its own LIGHTNING_FT_SNAPSHOT_DIR and LIGHTNING_FT_DOMAIN_ID (node identity);
* ``--strategy fsdp_ft``: the same with ``FaultTolerantFSDPStrategy``; the model shards its
  layers in ``configure_model`` (FSDP2 ``fully_shard`` over ``device_mesh["data_parallel"]``);
* ``--strategy ddp --devices 2`` under ``torchrun``: plain DDP, the reference and the baseline
  (``--checkpoint-dir``: Lightning ModelCheckpoint every ``--checkpoint-every`` steps, resumed
  from ``last.ckpt`` after torchrun restarts the workers).

Writes into ``--out`` (one file per process, named by pid):
  steps-<pid>.jsonl   {"t", "step", "rank", "loss"} for every completed training step
  start-<pid>.jsonl   {"t", "step", "rank", threads, fds, rss, retired_groups, shm_files} every time
                      training starts (after any restore)
  result-<pid>.json   {"rank", "trained", "step", "weights", "t"} when fit() returns
  exit-<pid>          the exit code, when the process leaves through SystemExit
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch


def _sleep_until_sigusr1(seconds: float) -> None:
    woken = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: woken.set())
    woken.wait(seconds)


def _inject_fault(spec: str) -> None:
    """``KIND:MODULE:QUALNAME[:N]``: on the N-th call (default 1) of that function this process
    signals itself -- kill (SIGKILL), stop (SIGSTOP) or term (SIGTERM) -- right before the call
    runs: a real fault at an exact point of lightning_ft's code, from outside it. ``store-stop``
    SIGSTOPs the store process instead (its pid in ``FT_TEST_STORE_PID``): the store host
    freezes at that point; ``store-kill`` SIGKILLs it."""
    import functools
    import importlib

    kind, module_name, qualname, *rest = spec.split(":")
    nth = int(rest[0]) if rest else 1
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM, "store-stop": signal.SIGSTOP,
           "store-kill": signal.SIGKILL}[kind]
    target = int(os.environ["FT_TEST_STORE_PID"]) if kind.startswith("store-") else os.getpid()
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = {"n": 0}

    @functools.wraps(original)
    def faulty(*a, **kw):
        calls["n"] += 1
        if calls["n"] == nth:
            print(f"FAULT {kind} in {qualname} (call {nth})", file=sys.stderr, flush=True)
            os.kill(target, sig)
        return original(*a, **kw)

    setattr(owner, name, faulty)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="ddp_ft", choices=["ddp_ft", "fsdp_ft", "ddp"])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1, help="plain ddp under torchrun with several agents")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--step-sleep-requeued", type=float, default=None,
                        help="--step-sleep once SLURM requeued the job (SLURM_RESTART_COUNT >= 1)")
    parser.add_argument("--resumable-data", action="store_true",
                        help="each step's batch comes from (global step, rank), not from the loader's position, so "
                             "a run resumed mid-epoch trains on exactly the batches an uninterrupted one would")
    parser.add_argument("--loader-data", action="store_true",
                        help="the training loader is lightning_ft.data.resumable_loader over the 256 samples (its "
                             "position is in every snapshot; an elastic job re-shards it by sample position)")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--snapshot-every", type=int, default=10,
                        help="EmergencyCheckpoint(every_n_steps=N); 0: none of the script's own, so ddp_ft adds "
                             "its default (the overhead-budget schedule)")
    parser.add_argument("--no-snapshots", action="store_true")
    parser.add_argument("--graceful", action="store_true", help="add GracefulTermination (no health probes)")
    parser.add_argument("--checkpoint-dir", default=None, help="baseline: ModelCheckpoint + resume from last")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--raise-at-step", type=int, default=None, help="training_step raises ValueError here")
    parser.add_argument("--raise-on-rank", type=int, default=0)
    # 10 s, not the 2 s a test of hang detection sets: on a loaded 2-core machine a step now and
    # then takes over 2 s while a peer's heartbeat lags 0.4 s, and a test of something else then
    # sees a hang recovery it did not provoke (frozen peers are still found in 2 s by their
    # silent heartbeats)
    parser.add_argument("--hang-floor", type=float, default=10.0)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--replication-factor", type=int, default=1)
    parser.add_argument("--ft-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra FaultTolerantDDPStrategy argument (value parsed as JSON, else a string)")
    parser.add_argument("--ft-by-name", action="store_true",
                        help='Trainer(strategy="ddp_ft"): every setting from LIGHTNING_FT_* (the ft options above '
                             "are ignored)")
    parser.add_argument("--sleep-before-fit", type=float, default=0.0,
                        help="a slow start: the process exists, but joins the run this much later "
                             "(or when it receives SIGUSR1)")
    parser.add_argument("--hold-first-step-while", default=None, metavar="PATH",
                        help="step 0 waits while PATH exists: a test lets spares arrive before training starts "
                             "(the first step of a round is exempt from hang detection)")
    parser.add_argument("--fault", action="append", default=[], metavar="KIND:MODULE:QUALNAME[:N]",
                        help="signal this process (kill|stop|term) at the N-th call of a function")
    parser.add_argument("--background-copy-min-bytes", type=int, default=None,
                        help="copy deferred snapshot tensors on the helper thread from this size on "
                             "(test knob: this script's small models stay below the library's threshold)")
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer (buffers forward changes)")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=N)")
    parser.add_argument("--explicit-callbacks", action="store_true",
                        help="EmergencyCheckpoint() and GracefulTermination() with no arguments, as a user adds them")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--weights-after-fit", action="store_true",
                        help="gather the full weights after fit() returned (a collective, as a user's code may run)")
    parser.add_argument("--csv-logs", default=None, help="a CSVLogger here; the loss logged every step")
    args = parser.parse_args()
    if args.background_copy_min_bytes is not None:
        from lightning_ft.checkpoint.memory import copying

        copying.BACKGROUND_MIN_BYTES = args.background_copy_min_bytes
    if args.step_sleep_requeued is not None and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) >= 1:
        args.step_sleep = args.step_sleep_requeued
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # stack dump on demand, for debugging hung runs

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format=f"[%(asctime)s pid={os.getpid()} %(name)s %(levelname)s] %(message)s")
    for noisy in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name in filter(None, os.environ.get("FT_DEBUG_LOGGERS", "").split(",")):  # to look into a test run
        logging.getLogger(name).setLevel(logging.DEBUG)

    import datetime

    import lightning.pytorch as pl
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_ft
    from lightning_ft import EmergencyCheckpoint, GracefulTermination

    for spec in args.fault:
        _inject_fault(spec)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            norm = [nn.BatchNorm1d(args.hidden)] if args.batchnorm else []
            self.net = nn.Sequential(nn.Linear(16, args.hidden), *norm, nn.ReLU(), nn.Linear(args.hidden, 1))

        def training_step(self, batch, batch_idx):
            if args.hold_first_step_while and self.trainer.global_step == 0:
                while os.path.exists(args.hold_first_step_while):
                    time.sleep(0.05)
            if args.step_sleep:
                # FT_TRAIN_SLOW="STEP:FACTOR": this process's steps take FACTOR x as long from STEP on (a straggler)
                slow_from, _, factor = os.environ.get("FT_TRAIN_SLOW", "-1:1").partition(":")
                slow = float(factor) if 0 <= int(slow_from) <= self.trainer.global_step else 1.0
                time.sleep(args.step_sleep * slow)
            if args.raise_at_step is not None and self.trainer.global_step == args.raise_at_step \
                    and self.trainer.global_rank == args.raise_on_rank:
                raise ValueError(f"deliberate bug at step {args.raise_at_step}")
            x, y = batch
            if args.resumable_data:
                g = torch.Generator().manual_seed(1_000_003 * self.trainer.global_step + self.trainer.global_rank)
                x = torch.randn(x.shape, generator=g)
                y = x.sum(dim=1, keepdim=True)
            loss = nn.functional.mse_loss(self.net(x), y)
            self.last_loss = float(loss.detach())
            if args.csv_logs:
                self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        if args.strategy == "fsdp_ft":
            # only then: a module that overrides configure_model has no model fingerprint before
            # setup, so a hot spare could not refuse a replica of another model (test_replica_trust)
            def configure_model(self):
                if isinstance(self.net, FSDPModule):  # configure_model runs every fit
                    return
                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def full_weights(self) -> list[float]:
            """Every parameter, whole (collective with sharded parameters: every rank calls it)."""
            tensors = [p.full_tensor() if isinstance(p, DTensor) else p for p in self.parameters()]
            return [float(v) for t in tensors for v in t.detach().flatten()]

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1234)
            x = torch.randn(256, 16, generator=g)
            dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
            if args.loader_data:
                from lightning_ft.data import resumable_loader

                return resumable_loader(dataset, args.batch_size, self.trainer, seed=7)
            return DataLoader(dataset, batch_size=args.batch_size, shuffle=True)

    def resources() -> dict:
        """What this process holds now (a test bounds it over many recoveries)."""
        from lightning_ft.runtime import transport

        shm = os.environ.get("LIGHTNING_FT_SNAPSHOT_DIR")
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
                "rss": rss, "retired_groups": len(transport._BROKEN_GROUPS),
                "shm_files": sum(len(files) for _, _, files in os.walk(shm)) if shm else None}

    class Recorder(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            pl_module.final_weights = pl_module.full_weights()  # here, while the round's group is up

        def on_train_start(self, trainer, pl_module):
            if os.environ.get("FT_TRAIN_PIN_CPU"):  # diagnosis: every thread of rank r on core r
                core = {trainer.global_rank % os.cpu_count()}
                for tid in os.listdir("/proc/self/task"):
                    os.sched_setaffinity(int(tid), core)
            with open(out / f"start-{pid}.jsonl", "a") as f:
                f.write(json.dumps({"t": time.time(), "step": trainer.global_step, "rank": trainer.global_rank,
                                    **resources()}) + "\n")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            with open(out / f"steps-{pid}.jsonl", "a") as f:
                f.write(json.dumps({"t": time.time(), "step": trainer.global_step, "rank": trainer.global_rank,
                                    "loss": pl_module.last_loss, "cpu": time.thread_time(),
                                    "pcpu": time.process_time()}) + "\n")

    callbacks: list[pl.Callback] = [Recorder()]
    if args.explicit_callbacks:
        callbacks += [EmergencyCheckpoint(), GracefulTermination()]
    if args.graceful:
        callbacks.append(GracefulTermination(probes=[]))
    if not args.no_snapshots and args.snapshot_every > 0 and not args.explicit_callbacks:
        callbacks.append(EmergencyCheckpoint(every_n_steps=args.snapshot_every))
    ckpt_path = None
    if args.checkpoint_dir:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=args.checkpoint_every,
                                         save_last=True, save_top_k=-1))
        if (Path(args.checkpoint_dir) / "last.ckpt").exists():
            ckpt_path = str(Path(args.checkpoint_dir) / "last.ckpt")

    pg_timeout = datetime.timedelta(seconds=args.pg_timeout)
    if args.strategy in ("ddp_ft", "fsdp_ft") and args.ft_by_name:
        strategy = args.strategy
    elif args.strategy in ("ddp_ft", "fsdp_ft"):
        options = {}
        for item in args.ft_option:
            key, _, raw = item.partition("=")
            try:
                options[key] = json.loads(raw)
            except json.JSONDecodeError:
                options[key] = raw
        strategy_class = (lightning_ft.FaultTolerantFSDPStrategy if args.strategy == "fsdp_ft"
                          else lightning_ft.FaultTolerantDDPStrategy)
        strategy = strategy_class(
            hang_timeout_floor=args.hang_floor, timeout=pg_timeout, replication_factor=args.replication_factor,
            **options)
    else:
        strategy = pl.strategies.DDPStrategy(timeout=pg_timeout)

    pl.seed_everything(0, verbose=False)
    model = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                         max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
                         max_epochs=-1, enable_progress_bar=False, enable_model_summary=False,
                         logger=pl.loggers.CSVLogger(args.csv_logs) if args.csv_logs else False, log_every_n_steps=1,
                         enable_checkpointing=bool(args.checkpoint_dir), num_sanity_val_steps=0,
                         callbacks=callbacks)
    if os.environ.get("FT_TRAIN_SWITCH_INTERVAL"):  # diagnosis: GIL hand-off cost of background threads
        sys.setswitchinterval(float(os.environ["FT_TRAIN_SWITCH_INTERVAL"]))
    profile_to = os.environ.get("FT_TRAIN_PROFILE")  # diagnosis: cProfile fit() into this directory
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    if args.sleep_before_fit:
        _sleep_until_sigusr1(args.sleep_before_fit)
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except SystemExit as exc:
        (out / f"exit-{pid}").write_text(str(exc.code))
        raise
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(str(Path(profile_to) / f"fit-{pid}.prof"))
    trained = getattr(trainer.strategy, "trained", True)
    result = {"rank": trainer.global_rank, "trained": trained, "step": trainer.global_step, "t": time.time(),
              "weights": model.full_weights() if args.weights_after_fit and trained else
              getattr(model, "final_weights", None) or model.full_weights()}
    (out / f"result-{pid}.json").write_text(json.dumps(result))
    if args.strategy == "ddp":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

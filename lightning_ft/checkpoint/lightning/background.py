"""Background snapshot copies of ``EmergencyCheckpoint``: a periodic snapshot's parameters and
optimizer state are copied on a helper thread while the next batch's forward and backward run,
and committed by an optimizer step pre-hook before that step changes them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ft.checkpoint.lightning.state import dump_state
from lightning_ft.checkpoint.memory.format import SnapshotError
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore

log = logging.getLogger(__name__)


def changed_only_by_optimizer_steps(optimizers: Iterable[torch.optim.Optimizer]) -> Callable[[torch.Tensor], bool]:
    """Whether a checkpoint tensor is (a view of) a parameter the optimizers update or one of
    their state tensors: between a batch's end and the next optimizer step only that step changes
    them. (A parameter no optimizer updates may be changed by anything, e.g. forward.)"""
    storages: set[int] = set()
    for optimizer in optimizers:
        storages.update(_storage(parameter) for group in optimizer.param_groups for parameter in group["params"])
        for state in optimizer.state.values():
            storages.update(_storage(value) for value in state.values() if isinstance(value, torch.Tensor))
    storages.discard(0)  # empty tensors share the null pointer
    return lambda tensor: tensor.untyped_storage().data_ptr() in storages


def _storage(tensor: torch.Tensor) -> int:
    # a DTensor (sharded state) has no storage of its own: its local shard has, and the
    # checkpoint holds that shard (checkpoint/sharded.py)
    to_local = getattr(tensor, "to_local", None)
    local = to_local() if callable(to_local) else tensor
    return local.untyped_storage().data_ptr()


class BackgroundSnapshots:
    """The periodic snapshot still copying in the background (at most one) and the optimizer
    step pre-hooks that commit it through ``commit(where)`` (``EmergencyCheckpoint.commit_pending``)."""

    def __init__(self) -> None:
        #: why background copies stopped in this fit (None: they did not)
        self.off: str | None = None
        # (persist?, seconds blocked, of them dump_checkpoint's) of the save not yet committed
        self._pending: tuple[bool, float, float] | None = None
        self._hooks: list[Any] = []
        self._commit: Callable[[str], Any] = lambda where: None

    @property
    def pending(self) -> bool:
        """Whether a snapshot started here is not yet committed."""
        return self._pending is not None

    def start(self, trainer: pl.Trainer, store: SnapshotStore, step: int) -> bool:
        """Start the periodic snapshot of ``step``: parameters and optimizer state copied on a
        helper thread until :meth:`commit` (the next optimizer step at the latest). False (logged)
        if it could not start."""
        start = time.perf_counter()
        try:
            checkpoint = dump_state(trainer)
            dumped = time.perf_counter() - start
            deferred = changed_only_by_optimizer_steps(trainer.optimizers)
            store.save_in_background(checkpoint, step, deferred, reason="periodic")
        except Exception:
            log.exception("rank %d: periodic snapshot at step %d failed", trainer.global_rank, step)
            return False
        self._pending = (True, time.perf_counter() - start, dumped)
        return True

    def commit(self, store: SnapshotStore | None, where: str = "") -> tuple[SnapshotInfo, bool, float] | None:
        """Commit the snapshot still copying, if any (waits for the copy): (what was committed,
        whether it is to be offered for a durable copy, what a synchronous save of it would have
        taken). None when nothing was committed: nothing pending, or abandoned with a logged
        reason (a tensor changed in place: background copies are off for this fit from then on)."""
        pending = self._pending
        if store is None or pending is None:
            return None
        self._pending = None
        if store.pending_step is None:
            return None  # the store committed it itself (e.g. closed)
        persist, blocked, dumped = pending
        step = store.pending_step
        start = time.perf_counter()
        try:
            info = store.commit_pending()
        except SnapshotError as exc:
            self.off = str(exc)
            log.warning("rank %d: %s; snapshots of this fit are copied synchronously from now on", store.rank, exc)
            return None
        except Exception:
            log.exception("rank %d: periodic snapshot at step %s failed", store.rank, step)
            return None
        if info is None:
            return None
        waited = time.perf_counter() - start
        timing = store.last_timing
        log.debug("rank %d: periodic snapshot at step %d committed%s: training blocked %.3f s", store.rank, info.step,
                  f" ({where})" if where else "", blocked + waited)
        # what a synchronous save_now of this state would take (the SIGTERM budget's estimate)
        return info, persist, dumped + timing.work if timing is not None else blocked + waited

    # ------------------------------------------------------------------ optimizer step pre-hooks
    def hook_optimizer_steps(self, optimizers: Iterable[torch.optim.Optimizer], commit: Callable[[str], Any]) -> None:
        """Commit a background snapshot before any optimizer step changes what it still copies
        (every optimizer step, automatic or manual optimization, runs torch's step pre-hooks)."""
        self.remove_hooks()
        self._commit = commit
        self._hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step) for optimizer in optimizers]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _before_optimizer_step(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Torch's step pre-hook. With a closure (Lightning's automatic optimization: forward and
        backward run inside ``step``), commit once the closure returned, before the update; else now."""
        if self._pending is None:
            return None
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is None:
            self._commit("optimizer step")
            return None

        def closure_then_commit() -> Any:
            loss = closure()
            self._commit("optimizer step")
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_commit}
        return (closure_then_commit, *args[1:]), kwargs

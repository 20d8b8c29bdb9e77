"""A rank's own work per training step: the step's time minus the time it waited for its peers.

In ``DistributedDataParallel`` the only wait for peers inside a step is the gradient all-reduce:
a rank whose backward finished early waits there for the slowest. The meter marks the moment
this rank's last gradient bucket is ready (a DDP communication hook that then runs torch's own
all-reduce hook, so the gradients are the same bits) and the moment the synchronised backward
returned (the optimizer's closure); everything else in the step -- loading the batch, forward,
backward, the optimizer update -- is this rank's own work:

    own  = (bucket ready - previous step's end) + (step's end - closure returned)
    wait = closure returned - bucket ready

Costs a few clock reads per step. Written on the training thread, read (a copy of the window)
by the round watchdog's thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_ft.stragglers.policy import WorkSummary, summarize


class WorkMeter:
    """Own work and wait of this rank's last ``window`` optimizer steps."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self, window: int) -> None:
        self.window = window
        self._work: deque[float] = deque(maxlen=window)
        self._wait: deque[float] = deque(maxlen=window)
        self._step_began: float | None = None
        self._ready: float | None = None
        self._synced: float | None = None
        self.last_step = -1

    @property
    def sync_hook(self) -> Callable[[Any, dist.GradBucket], Any]:
        """A DDP communication hook: torch's all-reduce hook, noting when the last bucket is ready."""
        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations, not strings
            if bucket.is_last():
                self._ready = self.clock()
            return default_hooks.allreduce_hook(state, bucket)
        return hook

    def timed_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (forward and the synchronised backward), noting when it returned."""
        def timed() -> Any:
            output = closure()
            self._synced = self.clock()
            return output
        return timed

    def begin(self) -> None:
        """Measuring starts (a round's training starts): the next step begins now."""
        self._step_began = self.clock()
        self._ready = self._synced = None

    def step_finished(self, step: int) -> None:
        """The optimizer step that completed ``step`` ended: record its own work and wait."""
        now = self.clock()
        began, ready, synced = self._step_began, self._ready, self._synced
        self._step_began, self._ready, self._synced = now, None, None
        if began is None or ready is None or synced is None or not began <= ready <= synced <= now:
            return  # no synchronised backward seen in this step: nothing to tell own work from waiting
        self._work.append((ready - began) + (now - synced))
        self._wait.append(synced - ready)
        self.last_step = step

    def summary(self) -> WorkSummary:
        """The current window's summary (safe from another thread: it reads copies)."""
        return summarize(self.last_step, list(self._work), list(self._wait))

"""A rank's own work per training step: the step's time minus the time it waited for its peers.

In ``DistributedDataParallel`` the only wait for peers inside a step is the gradient all-reduce:
a rank whose backward finished early waits there for the slowest. The meter marks the moment
this rank's backward finished computing -- the last gradient accumulated into a parameter (a
post-accumulate-grad hook on each parameter; DDP's own communication is left as it is) -- and
the moment the synchronised backward returned (the optimizer's closure); everything else in the
step -- loading the batch, forward, backward, the optimizer update -- is this rank's own work:

    own  = (last gradient ready - previous step's end) + (step's end - closure returned)
    wait = closure returned - last gradient ready

Under gradient accumulation a rank also waits between micro-batches: Lightning 2.6 broadcasts a
"SIGTERM received" flag from rank 0 before every training batch, so a fast rank waits there for
the slow one's previous micro-batch (measured: a 3x slower peer with two micro-batches scored
1.5, half of its fast peer's wait counted as its own work). The micro-batches before the step's
last one run without any collective of their own (DDP's ``no_sync``) from the batch's start hook
to the end of its backward, so that span is own work throughout; a step of K micro-batches counts
K times their mean as own work and the rest of the step as wait:

    own  = K * mean(batch start .. backward end, micro-batches 1 .. K-1)   (accumulation, K >= 2)
    wait = step's time - own

Costs a clock read per parameter and a few per step. Written on the training thread, read (a
copy of the window) by the round watchdog's thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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
        #: when the current micro-batch began and its backward ended, and how long each earlier
        #: one of this step computed
        self._micro_began: float | None = None
        self._backward_done: float | None = None
        self._unsynced: list[float] = []
        self.last_step = -1
        self._hooks: list[Any] = []

    def watch_gradients(self, module: nn.Module) -> None:
        """Note when each gradient of ``module``'s trainable parameters is ready (the last one of a
        step marks the end of this rank's backward); :meth:`close` removes the hooks."""
        for parameter in module.parameters():
            if parameter.requires_grad:
                self._hooks.append(parameter.register_post_accumulate_grad_hook(self._gradient_ready))

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        self._ready = self.clock()

    def close(self) -> None:
        """Remove the gradient hooks (the round is over; the next round's meter adds its own)."""
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()

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

    def micro_batch_started(self) -> None:
        """A training batch begins: the one before it, if it ended no optimizer step, was a
        micro-batch of gradient accumulation (no collective from its start to its backward's end)."""
        now = self.clock()
        began, done = self._micro_began, self._backward_done
        if began is not None and done is not None and began <= done:
            self._unsynced.append(done - began)
        self._micro_began, self._backward_done = now, None

    def backward_done(self) -> None:
        """A micro-batch's backward returned."""
        self._backward_done = self.clock()

    def step_finished(self, step: int) -> None:
        """The optimizer step that completed ``step`` ended: record its own work and wait."""
        now = self.clock()
        began, ready, synced = self._step_began, self._ready, self._synced
        unsynced, self._unsynced, self._micro_began, self._backward_done = self._unsynced, [], None, None
        self._step_began, self._ready, self._synced = now, None, None
        if began is None:
            return
        if unsynced:  # gradient accumulation: see the module docstring
            own = min(now - began, (len(unsynced) + 1) * sum(unsynced) / len(unsynced))
            self._work.append(own)
            self._wait.append(now - began - own)
            self.last_step = step
            return
        if ready is None or synced is None or not began <= ready <= synced <= now:
            return  # no synchronised backward seen in this step: nothing to tell own work from waiting
        self._work.append((ready - began) + (now - synced))
        self._wait.append(synced - ready)
        self.last_step = step

    def summary(self) -> WorkSummary:
        """The current window's summary (safe from another thread: it reads copies)."""
        return summarize(self.last_step, list(self._work), list(self._wait))

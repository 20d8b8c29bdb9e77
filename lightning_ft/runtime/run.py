"""What one process knows about its run across rounds, and what the fit loop needs of the runtime.

:class:`RunState` is created and written by the fit loop and the recovery executor; the
runtime's hooks only read it (they need the current round). :class:`RuntimeHost` is the part
of the runtime those two use, so neither imports the runtime (no import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lightning_ft.events import EventLog, NullEventLog
from lightning_ft.runtime.layout import StateLayout
from lightning_ft.runtime.session import RoundRuntime, Session
from lightning_ft.runtime.settings import StrategySettings


class RuntimeHost(Protocol):
    """The runtime as the fit loop and the recovery executor see it."""

    settings: StrategySettings
    session: Session | None
    layout: StateLayout

    @property
    def event_log(self) -> EventLog | NullEventLog: ...

    def open_session(self) -> Session: ...

    def leave_as_spare(self) -> None: ...

    def stop_round_threads(self) -> None: ...

    def cannot_reform(self) -> str | None:
        """Why a failed round cannot re-form in-process (None: it can)."""

    def saved_state(self) -> str | None:
        """What a relaunch resumes from when the job cannot go on in-process (None: nothing)."""

    def rebuild_module(self) -> None:
        """Return the model to what a fresh process builds before ``configure_model`` (sharded state)."""


@dataclass
class RunState:
    """One process's run: its trainer, the round it trains in, and the failures so far."""

    #: the Trainer whose fit() this process runs
    trainer: Any = None
    #: the round this process trains in (None while it waits, and under torchrun before fit)
    round: RoundRuntime | None = None
    #: True once this process trained in some round (False: it only ever was a hot spare)
    trained: bool = False
    #: how many times this process recovered from a failed round
    recoveries: int = 0
    #: failed rounds in a row without a step beyond the previous failure (see decide_recovery)
    failures_without_progress: int = 0
    #: the furthest step any failure struck at
    failed_at_step: int | None = None
    #: ``monotonic()`` of the failure that led to the current round (None for the first)
    failure_at: float | None = None

    def start_round(self, round_runtime: RoundRuntime) -> None:
        self.round = round_runtime
        self.trained = True

    def count_failure(self, step: int) -> int:
        """Record a failure at ``step``; returns the failures in a row without progress. Progress =
        a step completed beyond where the previous failure struck: a failure that recurs at the
        same point after every restore must not loop forever."""
        runtime = self.round
        advanced = runtime is not None and runtime.progressed and (self.failed_at_step is None
                                                                   or step > self.failed_at_step)
        self.failures_without_progress = 1 if advanced else self.failures_without_progress + 1
        self.failed_at_step = step if self.failed_at_step is None else max(step, self.failed_at_step)
        return self.failures_without_progress

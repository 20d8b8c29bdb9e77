"""A job's stages: a script's ``fit``, ``validate``, ``test`` and ``predict`` calls, in order.

Every participant runs the same script, so the k-th Trainer call is stage k on every one of them.
Each stage starts with a round of its own: the first participant to reach stage k once the round
of stage k-1 finished (its actives completed their work: ``RunRecords.finish_round``) opens the
next round and labels it the first of stage k (a sealed number); rounds opened after a failure
carry no label and belong to the stage of the round before. A participant behind the job (a spare
whose script is slower) finds a later stage in force and skips the one it is at: that stage ended
without it. Pure protocol over the run's records; nothing here knows Lightning.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

from lightning_ft._clock import monotonic
from lightning_ft.rendezvous.records import RunRecords


class Stages:
    """One participant's view of the job's stages (the labels it read are kept: they never change)."""

    def __init__(self, records: RunRecords, open_next_round: Callable[[int, str], int],
                 raise_if_closed: Callable[[], None], poll: float, clock: Callable[[], float] = monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.records = records
        self._open_next_round = open_next_round
        self._raise_if_closed = raise_if_closed
        self._poll = poll
        self._clock = clock
        self._sleep = sleep
        self._labels: dict[int, int] = {}

    def label(self, round_id: int) -> int | None:
        """The stage ``round_id`` is the first round of (None: it is not the first of a stage)."""
        if round_id not in self._labels:
            label = self.records.stage_label(round_id)
            if label is None:
                return None
            self._labels[round_id] = label
        return self._labels[round_id]

    def stage_of(self, round_id: int) -> int:
        """The stage ``round_id`` belongs to (0 before any label)."""
        for candidate in range(round_id, -1, -1):
            label = self.label(candidate)
            if label is not None:
                return label
        return 0

    def follows_a_failure(self, round_id: int) -> bool:
        """Whether ``round_id`` was opened after a failure (not the first round of the job or a stage)."""
        return round_id > 0 and self.label(round_id) is None

    def enter(self, stage: int, timeout: float) -> bool:
        """Before joining for ``stage``: make the current round one of it, opening its first round
        once the round of the stage before finished. False when the job is past ``stage`` already.
        Raises ``RendezvousTimeoutError`` when the stage before does not finish within ``timeout``."""
        deadline = self._clock() + timeout
        while True:
            self._raise_if_closed()
            round_id = self.records.current_round()
            current = self.stage_of(round_id)
            if current >= stage:
                return current == stage
            if self.records.round_finished(round_id):
                opened = self._open_next_round(round_id, f"stage {stage}")
                if opened == round_id + 1:
                    self._labels[opened] = self.records.label_stage(opened, stage)
                continue
            if self._clock() > deadline:
                raise RendezvousTimeoutError(
                    f"stage {stage} could not start within {timeout:g}s: round {round_id} of stage {current} "
                    "did not finish")
            self._sleep(self._poll)

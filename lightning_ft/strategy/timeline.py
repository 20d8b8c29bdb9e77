"""Events the ``ddp_ft`` strategy writes to the run's event log (:mod:`lightning_ft.events`).

One JSON line per event, in ``<run dir>/events-<participant>-<pid>.jsonl``; the run dir comes
from ``FaultTolerantDDPStrategy(events_dir=...)`` or ``$LIGHTNING_FT_EVENTS_DIR`` (no log
when neither is set). Every line carries ``t`` (wall clock), ``mono``, ``pid``, ``who``
(participant id) and ``event``; the fields below are added per event. ``cycle`` is the
rendezvous round, ``rank``/``world`` the rank and world size in it.

=============================  ==================================================================
event                          fields
=============================  ==================================================================
``join``                       participant, domain, endpoint, run_id, min_nodes, max_nodes
``round_complete``             cycle, rank, world, standby (bool: hot spare in this round)
``group_formed``               cycle, rank, world, seconds (init_process_group)
``snapshot_plan``              cycle, step (newest held by any rank, or null), source, receivers
``snapshot_sent``              cycle, step, to_rank, bytes, seconds
``snapshot_received``          cycle, step, from_rank, bytes, seconds
``restored``                   cycle, step (global step training resumes from)
``failure_detected``           cycle, step (training had reached), error, detector (``collective`` | ``hang`` | ``rendezvous``),
                               stalled (ranks blamed by the hang detector, if any)
``decision``                   cycle, kind (see :class:`~lightning_ft.strategy.decisions.FailureKind`),
                               action (``recover`` | ``raise`` | ``no_restart``), reason
``round_open``                 cycle (the new round), after (the failed round), reason
``first_step_after_recovery``  cycle, step, seconds_since_failure
``replica_published``          cycle, step, bytes (a snapshot put in the store for hot spares)
``replica_received``           step, bytes (a hot spare kept a copy)
``spare_exit``                 reason (a hot spare leaves ``fit()``; exit 0)
``no_restart``                 reason (the job cannot go on; exit 83)
``stopped``                    cycle, reason (SIGTERM path or another deliberate stop)
``finished``                   cycle, rank, step, seconds (fit completed and the exit barrier passed)
=============================  ==================================================================

Lost time of a recovery = ``first_step_after_recovery.t - failure_detected.t`` (re-forming)
plus the steps trained after the snapshot that was restored (``failure`` step minus
``restored.step``, times the step time).
"""

from __future__ import annotations

from typing import Any

from lightning_ft.events import EventLog, NullEventLog, event_log_from_env

JOIN = "join"
ROUND_COMPLETE = "round_complete"
GROUP_FORMED = "group_formed"
SNAPSHOT_PLAN = "snapshot_plan"
SNAPSHOT_SENT = "snapshot_sent"
SNAPSHOT_RECEIVED = "snapshot_received"
RESTORED = "restored"
FAILURE_DETECTED = "failure_detected"
DECISION = "decision"
ROUND_OPEN = "round_open"
FIRST_STEP_AFTER_RECOVERY = "first_step_after_recovery"
REPLICA_PUBLISHED = "replica_published"
REPLICA_RECEIVED = "replica_received"
SPARE_EXIT = "spare_exit"
NO_RESTART = "no_restart"
STOPPED = "stopped"
FINISHED = "finished"

ALL_EVENTS = (JOIN, ROUND_COMPLETE, GROUP_FORMED, SNAPSHOT_PLAN, SNAPSHOT_SENT, SNAPSHOT_RECEIVED, RESTORED,
              FAILURE_DETECTED, DECISION, ROUND_OPEN, FIRST_STEP_AFTER_RECOVERY, REPLICA_PUBLISHED,
              REPLICA_RECEIVED, SPARE_EXIT, NO_RESTART, STOPPED, FINISHED)


class Timeline:
    """The strategy's event log; never lets a logging problem break training."""

    def __init__(self, who: str, run_dir: str | None) -> None:
        try:
            self._log: EventLog | NullEventLog = event_log_from_env(who, run_dir)
        except OSError:
            self._log = NullEventLog()

    @property
    def enabled(self) -> bool:
        return isinstance(self._log, EventLog)

    @property
    def path(self) -> str | None:
        return str(self._log.path) if isinstance(self._log, EventLog) else None

    def emit(self, event: str, **fields: Any) -> None:
        try:
            self._log.emit(event, **fields)
        except OSError:
            pass

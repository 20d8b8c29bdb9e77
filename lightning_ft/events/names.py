"""Every event a lightning_ft process writes to its run's event log, by name.

One JSON line per event (see :mod:`lightning_ft.events.log`); every line carries ``t`` (wall
clock), ``mono``, ``pid``, ``who`` (participant id, or ``rank<R>`` for the SIGTERM path
outside ``ddp_ft``) and ``event``; the fields below are added per event. ``round`` is the
rendezvous round (under torchrun: its worker-group restart count), ``rank``/``world`` the
rank and world size in it.

The ``ddp_ft`` strategy (recovery):

=============================  ==================================================================
event                          fields
=============================  ==================================================================
``join``                       participant, domain, endpoint, run_id, min_nodes, max_nodes, store_host
``round_complete``             round, rank, world, standby (bool: hot spare in this round)
``group_formed``               round, rank, world, seconds (init_process_group)
``snapshot_plan``              round, step (newest held by any rank, or null), source, receivers
``snapshot_sent``              round, step, to_rank, bytes, seconds
``snapshot_received``          round, step, from_rank, bytes, seconds
``shard_replica``              round, step, to_ranks, bytes, seconds (``fsdp_ft``: this rank's snapshot copied to
                               ranks in other failure domains; seconds: what the copy held training up,
                               sending, receiving and writing the copies this rank keeps)
``work``                       round, step, steps, busy_seconds, wait_seconds (this rank's median own work per
                               step and median wait for its peers over its last ``steps`` steps; every
                               ``straggler_window`` steps)
``straggler``                  round, rank, step, action (``evict`` | ``warn``), score (own work over the peers'
                               median), reason (rank 0: the straggler policy found a persistently slow rank)
``evicted``                    round, step, reason (this rank leaves as a straggler; exit 84)
``handed_over``                round, step, reason (this rank was signalled and hot spares take its place:
                               it leaves the job, exit 0; the job goes on)
``hand_over``                  round, step, reason (the survivors of a hand-over re-form with spares, or the
                               elastic job shrinks, from their live state)
``grow``                       round, step, reason (an elastic job re-forms to take in participants that
                               arrived while it trained)
``restored``                   round, step (global step training resumes from)
``failure_detected``           round, step (training had reached), error, detector (``collective`` | ``hang`` |
                               ``rendezvous`` | ``agent``: torchrun's agent re-joined after an active round),
                               stalled (ranks blamed by the hang detector), stuck_seconds, step_seconds
                               (median step of the failed round; prices the redone steps)
``decision``                   round, kind (:class:`~lightning_ft.runtime.decisions.FailureKind`),
                               action (``recover`` | ``raise`` | ``no_restart``), reason
``round_open``                 round (the new round), after (the failed round), reason
``first_step_after_recovery``  round, step, seconds_since_failure
``replica_published``          round, step, bytes (a snapshot put in the store for hot spares, encrypted;
                               only with a job secret)
``replica_received``           step, bytes (a hot spare kept a copy)
``replica_refused``            step, bytes (announced), stage, error (a hot spare dropped a replica: ``meta``:
                               of another run or model, or larger than ``replica_max_bytes``, before any
                               byte of it was read; ``header``: its first chunk is not what the meta
                               announced; ``contents``: it fails the checks of a received snapshot, e.g.
                               metadata the restricted loader refuses)
``store_failover``             epoch, endpoint, hosting (bool: this process serves it now), seconds (from
                               confirming the loss to reconnected), successor (participant that hosts it)
``spare_exit``                 reason (a hot spare was not needed in a stage: its Trainer call returns)
``state_received``             round, source (rank), stage (the fit whose module state this rank received:
                               it stood by in that fit and is active now)
``no_restart``                 round, reason (the job cannot go on; exit 83)
``node_fault``                 round, step, error, errno (this node's storage failed, e.g. ENOSPC; it leaves
                               as unhealthy, exit 82, and its peers recover without it)
``stopped``                    round, reason (SIGTERM path or another deliberate stop; a participant
                               stopped while waiting in the rendezvous exits 143)
``finished``                   round, rank, step, seconds (a stage -- fit, validate, test, predict -- completed
                               and the exit barrier passed),
                               step_seconds (median step of the last round)
``agent_exit``                 round, outcome (``finished``: its workers finished and passed the exit barrier |
                               ``gave_up``: its workers failed and it leaves), reason (torchrun's agent, with
                               ``--rdzv-backend=lightning_ft``; the workers log their own ``finished``)
=============================  ==================================================================

The SIGTERM path (``GracefulTermination``):

=============================  ==================================================================
``termination_signal``         signal, step
``health_report``              healthy, reasons, duration_s
``stop_agreed``                step, stop_step, proposer, reason
``termination_decision``       step, action, exit_code, tier (``memory``, ``memory+shard``, ``durable``:
                               where the state is; ``none``), reasons (the first says where and why
                               this rank stopped: the agreed step, an unhealthy peer, a store that did
                               not answer), seconds_since_signal
``unhealthy_exit``             exit_code, reasons, step, seconds_since_signal
``hand_over_verdict``          step, hands_over (bool), leavers, leaving (bool: this rank; null without a
                               hand-over), reason, seconds_since_signal (with hot spares: whether the
                               signalled hand their places over or the whole job stops)
=============================  ==================================================================

Snapshots (``EmergencyCheckpoint``, any strategy):

=============================  ==================================================================
``snapshot_schedule``          step, snapshot_every_n_steps, persist_every_n_steps, seconds_per_step,
                               save_seconds (rank 0, when the ranks agree on a new schedule)
``durable_upload``             step, bytes, seconds, complete (this rank's shard is durable; ``complete``:
                               every rank's shard of the step is, and its manifest is written)
``durable_failed``             step, error (a durable copy failed; the step is not durable)
``live_state``                 step, saved (bool), reason, seconds, bytes (after a failure inside the next
                               optimizer step: the last step boundary snapshotted from the live state, or why
                               not -- then the newest snapshot stands)
``durable_pacing``             slowdown (None: raised to keep up with the copies), busy_steps,
                               idle_steps, mib_per_second_before, mib_per_second (the upload bound changed)
=============================  ==================================================================

Lost time of a recovery = ``first_step_after_recovery.t - failure_detected.t`` (re-forming)
plus the steps trained again: the failure step minus ``restored.step``, times the step time
(``failure_detected.step_seconds``, the median step of the failed round).
"""

from __future__ import annotations

# the ddp_ft strategy
JOIN = "join"
ROUND_COMPLETE = "round_complete"
GROUP_FORMED = "group_formed"
SNAPSHOT_PLAN = "snapshot_plan"
SNAPSHOT_SENT = "snapshot_sent"
SNAPSHOT_RECEIVED = "snapshot_received"
SHARD_REPLICA = "shard_replica"
WORK = "work"
STRAGGLER = "straggler"
EVICTED = "evicted"
HANDED_OVER = "handed_over"
HAND_OVER = "hand_over"
GROW = "grow"
RESTORED = "restored"
FAILURE_DETECTED = "failure_detected"
DECISION = "decision"
ROUND_OPEN = "round_open"
FIRST_STEP_AFTER_RECOVERY = "first_step_after_recovery"
REPLICA_PUBLISHED = "replica_published"
REPLICA_RECEIVED = "replica_received"
REPLICA_REFUSED = "replica_refused"
SPARE_EXIT = "spare_exit"
STATE_RECEIVED = "state_received"
STORE_FAILOVER = "store_failover"
NO_RESTART = "no_restart"
NODE_FAULT = "node_fault"
STOPPED = "stopped"
FINISHED = "finished"
AGENT_EXIT = "agent_exit"

# the SIGTERM path
TERMINATION_SIGNAL = "termination_signal"
HEALTH_REPORT = "health_report"
STOP_AGREED = "stop_agreed"
TERMINATION_DECISION = "termination_decision"
UNHEALTHY_EXIT = "unhealthy_exit"
HAND_OVER_VERDICT = "hand_over_verdict"

# snapshots
SNAPSHOT_SCHEDULE = "snapshot_schedule"
DURABLE_UPLOAD = "durable_upload"
DURABLE_FAILED = "durable_failed"
DURABLE_PACING = "durable_pacing"
LIVE_STATE = "live_state"

#: a participant whose log ends with one of these left on its own terms
EXIT_EVENTS = (FINISHED, SPARE_EXIT, NO_RESTART, NODE_FAULT, STOPPED, TERMINATION_DECISION, UNHEALTHY_EXIT,
               EVICTED, HANDED_OVER, AGENT_EXIT)

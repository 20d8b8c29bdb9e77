"""Process exit codes that tell the scheduler what happened."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Exit status of a lightning_ft process.

    Every value but ``SUCCESS`` is non-zero and distinct from the codes a shell or
    a signal produces (1, 2, 126-128, 128+N), so a scheduler rule can match them.
    """

    SUCCESS = 0
    #: State was saved (emergency snapshot committed); requeue the job.
    PREEMPTED = 81
    #: This node is unhealthy and exited without saving; healthy peers hold the
    #: state. Requeue the job, but do not place it on this node again.
    UNHEALTHY_NODE = 82
    #: Unrecoverable (e.g. no hot spare left, bad configuration); do not requeue.
    NO_RESTART = 83

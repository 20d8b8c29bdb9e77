"""Process exit codes that tell the scheduler what happened, and the one exception that exits with one."""

from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    """Exit status of a lightning_ft process.

    The codes of our own (81-83) are non-zero and distinct from the codes a shell or a signal
    produces (1, 2, 126-128, 128+N), so a scheduler rule can match them. ``STOPPED`` is the
    conventional code of a SIGTERM death on purpose: a process stopped by SIGTERM that saved
    nothing says exactly that.
    """

    SUCCESS = 0
    #: State was saved (emergency snapshot committed); requeue the job.
    PREEMPTED = 81
    #: This node is unhealthy and exited without saving; healthy peers hold the
    #: state. Requeue the job, but do not place it on this node again.
    UNHEALTHY_NODE = 82
    #: Unrecoverable (e.g. no hot spare left, bad configuration); do not requeue.
    NO_RESTART = 83
    #: Evicted as a straggler: this node was persistently slower than its peers and a hot spare
    #: took its place; the job goes on without it. Inspect the node before using it again.
    EVICTED = 84
    #: Stopped by SIGTERM (here or elsewhere in the job) with nothing of its own saved: 128 + SIGTERM.
    STOPPED = 128 + signal.SIGTERM


def stopped_by(signum: int) -> int:
    """The code of a stop by ``signum`` that saved nothing: 128 + signal, like a death by that signal
    (:attr:`ExitCode.STOPPED` for SIGTERM)."""
    return 128 + int(signum)


class FaultTolerantExit(SystemExit):
    """Ends the process with ``exit_code`` (a :class:`ExitCode`, or :func:`stopped_by` another
    signal) and says why. A ``SystemExit``, so Lightning runs its interrupt handling (every
    callback's ``on_exception``, logger finalization, teardown) and the interpreter then exits
    with that code, unlike Lightning's own ``SIGTERMException`` (exit 0)."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(int(exit_code))
        self.exit_code = ExitCode(exit_code) if exit_code in ExitCode._value2member_map_ else int(exit_code)
        self.message = message

    def __str__(self) -> str:
        name = f" ({self.exit_code.name})" if isinstance(self.exit_code, ExitCode) else ""
        return f"exit {int(self.exit_code)}{name}: {self.message}"


class JobCannotGoOn(RuntimeError):
    """Raised inside ``fit()`` when the job cannot go on whatever its participants do (e.g. no step
    whose shards all exist is left after a loss); the strategy ends every participant with
    ``NO_RESTART`` (83) and this message, instead of treating it as a bug of the training code."""


class StragglerEvicted(RuntimeError):
    """Raised inside ``fit()`` at a step boundary on the rank the straggler policy evicted: the
    strategy withdraws it from the job (never placed again) and ends it with ``EVICTED`` (84)."""


class JobEndedError(RuntimeError):
    """Raised by a Trainer call (``fit``, ``validate``, ``test``, ``predict``) made after an earlier
    stage of this process ended the job with an error of its own, which the script caught: the
    job's other participants have left, so no later stage can run in this run (a job of one
    participant goes on instead). Catchable, as the error that ended the job was."""


class HandOver(RuntimeError):
    """Raised inside ``fit()`` at the step boundary after a hand-over verdict (a SIGTERM that reached
    some actives while hot spares wait): on a ``leaving`` rank the strategy withdraws it from the
    job and ends it with ``SUCCESS`` (0: it handed its place over, the job goes on); on the others
    it re-forms the group with the spares from the live state."""

    def __init__(self, leaving: bool, reason: str, grow: bool = False) -> None:
        super().__init__(reason)
        self.leaving = leaving
        self.reason = reason
        #: not a hand-over: an elastic job re-forms to take in participants that arrived
        self.grow = grow

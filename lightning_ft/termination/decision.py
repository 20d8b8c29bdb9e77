"""Pure decisions for the SIGTERM path: what to do, with which exit code, and why.

No I/O, no clocks: callers pass in times and measurements, so these are unit-testable
with a fake clock.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_ft.exit_codes import ExitCode
from lightning_ft.schema.termination import HandOverVerdict

DEFAULT_GRACE_SECONDS = 30.0


class Action(enum.Enum):
    SAVE_THEN_EXIT = "save-then-exit"
    EXIT_WITHOUT_SAVE = "exit-without-save"


@dataclass(frozen=True)
class Decision:
    """What this node does after the stop step; ``exit_code`` assumes the action succeeds."""

    action: Action
    exit_code: int
    reasons: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.action.value} (exit {self.exit_code}): {'; '.join(self.reasons)}"


def hands_over_on(signum: int) -> bool:
    """Whether a node that received ``signum`` hands its place over to a hot spare (SIGTERM: a
    scheduler takes the node) rather than stopping the whole job with the others (SIGINT: Ctrl-C,
    a user ending the job; a second Ctrl-C raises ``KeyboardInterrupt`` at once)."""
    return signum != signal.SIGINT


def not_saved_exit_code(signum: int) -> int:
    """Exit code when this stop saved no emergency snapshot: 128 + signal, like a signal death.

    ``PREEMPTED`` (81) promises "state saved"; when nothing was saved the truthful code is
    the conventional "terminated by SIGTERM" 143, which schedulers also treat as a
    requeueable termination but which no rule for 81 will mistake for a saved state.
    """
    return 128 + int(signum)


def decide_on_termination(
    *,
    healthy: bool,
    health_reasons: tuple[str, ...] | list[str] = (),
    has_emergency_checkpoint: bool,
    budget_left_s: float,
    estimated_save_s: float | None,
    signum: int = signal.SIGTERM,
    save_safety_factor: float = 1.5,
) -> Decision:
    """Decide between an emergency snapshot and an exit without one.

    Args:
        healthy: verdict of the node-health check (an overrun already counted per policy).
        health_reasons: why the node is unhealthy, for the log.
        has_emergency_checkpoint: an ``EmergencyCheckpoint`` is in ``trainer.callbacks``.
        budget_left_s: seconds left before the expected SIGKILL, minus the exit reserve.
        estimated_save_s: measured cost of recent snapshots (``None`` = never measured).
        signum: the signal that started the termination (for the not-saved exit code).
        save_safety_factor: the estimate is multiplied by this before comparing.
    """
    if not healthy:
        reasons = tuple(health_reasons) or ("health check failed",)
        return Decision(Action.EXIT_WITHOUT_SAVE, int(ExitCode.UNHEALTHY_NODE),
                        ("node unhealthy, healthy peers hold the state", *reasons))
    not_saved = not_saved_exit_code(signum)
    if not has_emergency_checkpoint:
        return Decision(Action.EXIT_WITHOUT_SAVE, not_saved,
                        ("no EmergencyCheckpoint callback configured: nothing saved at this stop",))
    if budget_left_s <= 0:
        return Decision(Action.EXIT_WITHOUT_SAVE, not_saved,
                        (f"no time left before the grace period ends ({budget_left_s:.2f} s)",))
    if estimated_save_s is None:
        return Decision(Action.SAVE_THEN_EXIT, int(ExitCode.PREEMPTED),
                        (f"node healthy; save cost not measured yet, trying with {budget_left_s:.1f} s left",))
    needed = estimated_save_s * save_safety_factor
    if needed > budget_left_s:
        return Decision(Action.EXIT_WITHOUT_SAVE, not_saved,
                        (f"save would not fit: needs ~{needed:.2f} s ({estimated_save_s:.2f} s x "
                         f"{save_safety_factor:g}), {budget_left_s:.2f} s left",))
    return Decision(Action.SAVE_THEN_EXIT, int(ExitCode.PREEMPTED),
                    (f"node healthy; save needs ~{needed:.2f} s, {budget_left_s:.2f} s left",))


class BoundaryAction(enum.Enum):
    """What a rank that knows of a termination does at an optimizer-step boundary."""

    CONTINUE = "continue"  # train the next step
    HOLD = "hold"  # wait (bounded) until every rank confirmed the stop, then train the stop step
    STOP = "stop"  # stop here: decide, save or not, exit


def decide_at_boundary(*, step: int, stop_step: int, peer_unhealthy: bool, all_confirmed: bool) -> BoundaryAction:
    """The rank just completed optimizer step ``step``; the agreed stop is after ``stop_step``.

    Why HOLD keeps the agreement exact although no rank asks the store at its boundaries: a
    rank completes step ``stop_step`` only after every rank entered that step's gradient
    all-reduce. A rank that holds before it until all ranks confirmed therefore lets no rank
    complete the stop step without knowing it (a rank confirms only after its watcher
    published the request where its training thread reads it). A peer that left unhealthy
    will fail our next collective: stop at once, from the last completed step.
    """
    if peer_unhealthy or step >= stop_step:
        return BoundaryAction.STOP
    if step == stop_step - 1 and not all_confirmed:
        return BoundaryAction.HOLD
    return BoundaryAction.CONTINUE


def decide_hand_over(*, world_size: int, signalled: Iterable[int], unhealthy: Iterable[int],
                     spares_ready: int | None, min_world_size: int | None = None) -> HandOverVerdict:
    """A termination that reached only some actives: do they hand over to hot spares, or does the job stop?

    ``signalled``: ranks that received the signal themselves; ``unhealthy``: ranks that left as
    unhealthy or are gone (died during the settle); ``spares_ready``: live hot spares not signalled
    themselves (``None``: this job cannot re-form in-process -- plain DDP, torchrun's agent
    restarts the workers, a job of one process).
    The signalled and the unhealthy leave; everyone else goes on when a spare takes every
    leaver's place -- or, in an elastic job (``min_world_size``: its ``min_nodes``), when the
    survivors and the spares are at least ``min_world_size``: the job shrinks. When every active
    leaves (scancel, the time limit, a preempted job) or too few would be left, nobody hands over:
    the whole job stops at the agreed step as without spares.
    """
    leaving = tuple(sorted({r for r in (*signalled, *unhealthy) if 0 <= r < world_size}))
    if spares_ready is None:
        return HandOverVerdict((), "this job cannot re-form in-process: the whole job stops")
    if not leaving:
        return HandOverVerdict((), "no rank says it was signalled: the whole job stops")
    if len(leaving) >= world_size:
        return HandOverVerdict((), f"every active was signalled, is unhealthy or is gone ({world_size} of "
                                   f"{world_size}): the whole job stops")
    left = world_size - len(leaving) + spares_ready
    if spares_ready < len(leaving) and min_world_size is not None and left >= min_world_size:
        return HandOverVerdict(leaving, f"ranks {list(leaving)} of {world_size} leave; with {spares_ready} hot "
                                        f"spare(s) the elastic job shrinks to {left} (min_nodes={min_world_size})")
    if spares_ready < len(leaving):
        return HandOverVerdict((), f"{len(leaving)} of {world_size} actives leave (ranks {list(leaving)}) but "
                                   f"{spares_ready} hot spare(s) are ready: the whole job stops")
    return HandOverVerdict(leaving, f"ranks {list(leaving)} of {world_size} leave; {len(leaving)} of "
                                    f"{spares_ready} ready hot spare(s) take their places")


def hand_over_verdict_problem(verdict: HandOverVerdict, *, world_size: int, rank: int,
                              own_reason_to_leave: bool) -> str | None:
    """Why ``rank`` must not act on a hand-over verdict read from the store (None: it may).

    Holds with and without a job secret (without one, any client of the store can publish a
    verdict): a rank leaves only with a reason of its own -- it received the signal, or it was
    found unhealthy -- and never on a verdict :func:`decide_hand_over` cannot give: every active
    leaving (that is the whole job stopping, which saves and is requeued) or a rank outside the
    world. A verdict that keeps this rank is acted on: its worst is a re-form with the spares.
    """
    if not verdict.hands_over:
        return None
    leavers = set(verdict.leavers)
    outside = sorted(r for r in leavers if r >= world_size)
    if outside:
        return f"it names rank(s) {outside} outside the world of {world_size}"
    if len(leavers) >= world_size:
        return f"every active would leave ({world_size} of {world_size}), which no hand-over does"
    if rank in leavers and not own_reason_to_leave:
        return f"it has rank {rank} leave, which was neither signalled nor found unhealthy"
    return None


def budget_left(*, grace_s: float, signal_time: float, now: float, exit_reserve_s: float) -> float:
    """Seconds still usable for a save: grace minus time since the signal minus the exit reserve."""
    return grace_s - (now - signal_time) - exit_reserve_s


def resolve_grace_seconds(configured: float | None, source: str,
                          torchrun_shutdown: tuple[str, str] | None = None) -> tuple[float, str]:
    """Grace period (seconds from SIGTERM to SIGKILL) and where it came from.

    ``configured`` (the ``grace_seconds`` setting, from ``source``), else 30 s (Kubernetes
    ``terminationGracePeriodSeconds``, SLURM ``KillWait`` and torchrun defaults). Under torchrun
    (``torchrun_shutdown``: the variable and value of its worker shutdown timeout), that timeout
    caps the result, because the agent SIGKILLs the workers after it no matter what the scheduler
    allows.
    """
    if configured is not None:
        grace = float(configured)
    else:
        grace, source = DEFAULT_GRACE_SECONDS, "default"
    if torchrun_shutdown is not None:
        key, raw = torchrun_shutdown
        agent_timeout = _positive(key, raw)
        if agent_timeout < grace:
            grace, source = agent_timeout, f"{key} (torchrun SIGKILLs workers after it)"
    return grace, source


def _positive(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"environment variable {key}={raw!r} must be > 0 seconds")
    return value

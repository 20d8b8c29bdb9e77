"""Every bounded wait of lightning_ft, in seconds: one object, each bound a named field.

A wait in the code takes its bound from here (never a literal), and every store connection is
bounded by :class:`~lightning_ft.deadlines.BoundedStore` with ``store_timeout`` (or a tighter
field named here). The torchrun backend and ``Trainer(strategy="ddp_ft")`` share these
defaults. Three of them are public settings (``join_timeout``, ``heartbeat_interval``,
``store_timeout``), some advanced ones; the bounds of internal waits (a thread's stop, a call on
the SIGTERM path, a fail-over) are :func:`~lightning_ft.settings.fields.internal` constants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_ft.settings.fields import SettingsError, internal, number, setting

_positive = number()


def _SECONDS(value: object) -> str | None:
    return None if _positive(value) is None else "a positive number of seconds"


#: the bounds the barrier rendezvous and its torchrun handler use (what ``--rdzv-conf`` may set)
RENDEZVOUS_TIMEOUTS = ("join_timeout", "rejoin_timeout", "last_call_timeout", "elastic_start_window",
                       "previous_active_grace", "replacement_wait", "store_grace_timeout", "heartbeat_interval",
                       "connect_timeout", "store_timeout", "health_timeout")


@dataclass(frozen=True)
class Timeouts:
    """Bounds and timings of every wait, in seconds."""

    # the barrier rendezvous
    join_timeout: float = setting(600.0, "the first round a participant joins must complete within this",
                                  rule=_SECONDS)
    rejoin_timeout: float = setting(120.0, "a round after a failure (this participant trained in an earlier one) "
                                           "must complete within this", rule=_SECONDS, advanced=True)
    last_call_timeout: float = setting(0.3, "after min_nodes arrived, wait this long for more before completing",
                                       rule=_SECONDS, advanced=True)
    elastic_start_window: float = setting(5.0, "an elastic job's first round waits up to this long after it "
                                               "opened for the nodes started with the job (up to max_nodes), so "
                                               "that they all train from step 0; it completes as soon as max_nodes "
                                               "arrived", rule=_SECONDS, advanced=True)
    previous_active_grace: float = setting(3.0, "survivors of the previous round keep their places for this long "
                                                "after a round opens", rule=_SECONDS, advanced=True)
    replacement_wait: float = setting(10.0, "a round that too many lost nodes left short of min_nodes waits this "
                                            "long for a replacement (a node its scheduler restarts, which rejoins "
                                            "as a spare) before the job stops (81: saved)", rule=_SECONDS,
                                      advanced=True)
    store_grace_timeout: float = setting(3.0, "the store host waits at most this long for the others to "
                                              "acknowledge the end before its process (and the store) goes",
                                         rule=_SECONDS, advanced=True)
    heartbeat_interval: float = setting(0.1, "participants raise a sealed heartbeat this often; one silent for 4 "
                                             "beats is dead", rule=_SECONDS, advanced=True)
    # the store
    connect_timeout: float = setting(60.0, "bound on reaching the rendezvous store", rule=_SECONDS, advanced=True)
    store_timeout: float = setting(30.0, "bound on any one store call once connected: a frozen store host makes "
                                         "the call fail after this long (and later calls at once)", rule=_SECONDS)
    failover_timeout: float = internal(10.0, "bound on a store fail-over: finding the participant that takes the "
                                           "lost store over, its quorum, rebuilding the state and reconnecting")
    probe_timeout: float = internal(0.5, "bound on asking one participant's presence listener whether it is alive "
                                       "(during a fail-over)")
    # the strategy
    init_timeout: float = setting(60.0, "bound on building the process group of a round (and on the teardown "
                                        "after a failure)", rule=_SECONDS, advanced=True)
    exit_barrier_timeout: float = setting(60.0, "bound on waiting for the other actives at the end of fit()",
                                          rule=_SECONDS, advanced=True)
    watchdog_store_timeout: float = internal(5.0, "bound on one store call of the round watchdog: a rank that "
                                                "cannot progress breaks the group within the hang timeout plus "
                                                "this")
    failure_notice_timeout: float = internal(2.0, "how long classifying a failure waits for the store's notices "
                                                "(failed peers, verdicts, the close)")
    thread_stop_timeout: float = internal(2.0, "how long stopping a background thread (watchdog, spare monitor, "
                                             "replica publisher) waits for it; one still busy is left behind "
                                             "(a daemon thread)")
    # the SIGTERM path
    health_timeout: float = setting(5.0, "deadline of the node-health check", rule=_SECONDS, advanced=True,
                                    env="LIGHTNING_FT_HEALTH_TIMEOUT")
    stop_store_timeout: float = internal(2.0, "the longest a call on the training thread waits for the store on "
                                            "the SIGTERM path (proposing the stop step, awaiting every rank's "
                                            "confirmation, asking about peers); without an answer the rank stops "
                                            "where it is")
    exit_timeout: float = internal(5.0, "once a termination decided, the process is forced out with the decided "
                                       "code if still alive after this long")
    announce_timeout: float = internal(0.5, "publishing an unhealthy exit never delays that exit by more")
    watcher_close_timeout: float = internal(0.5, "ending the stop watcher at the end of fit() waits at most this")
    flush_timeout: float = internal(0.2, "flushing output on a forced exit gives up after this (a stalled pipe "
                                       "must not block the exit)")

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            problem = _SECONDS(value)
            if problem is not None:
                raise SettingsError(f"{item.name} must be {problem}, got {value!r}")

    def join_timeout_for(self, was_active: bool) -> float:
        """The bound on completing a round: ``rejoin_timeout`` after this participant trained."""
        return self.rejoin_timeout if was_active else self.join_timeout


#: the defaults, for code that runs before (or outside) any configuration
DEFAULT_TIMEOUTS = Timeouts()

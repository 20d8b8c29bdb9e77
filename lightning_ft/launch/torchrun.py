"""torch elastic ``RendezvousHandler`` for the barrier rendezvous (``--rdzv-backend=lightning_ft``).

Registered under the entry-point group ``torchrun.handlers``; torch also finds it through
``torch.distributed.elastic.rendezvous.registry.get_rendezvous_handler``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from lightning_ft._logging import ensure_log_output
from lightning_ft._torch import exit_barrier_names
from lightning_ft.deadlines import raw_store
from lightning_ft.events import names as ev
from lightning_ft.events.log import EventLog, NullEventLog, open_event_log
from lightning_ft.launch.factory import Participant, open_participant
from lightning_ft.process import exit_now
from lightning_ft.rendezvous.barrier import BarrierRendezvous, RoundResult, UnhealthyNodeError
from lightning_ft.rendezvous.participant import local_participant
from lightning_ft.rendezvous.settings import RendezvousConfigError, torchrun_config
from lightning_ft.schema.run import EXIT_BARRIER_KEY, EXIT_BARRIER_PREFIX, CloseKind, CloseReason
from lightning_ft.schema.signing import SecretError, job_signer
from lightning_ft.store.tcp import parse_endpoint

log = logging.getLogger(__name__)


def _check_torch_exit_barrier_key() -> None:
    # Standby nodes leave when torch's agents have passed their exit barrier, seen as this
    # key; if a torch version renamed it they would wait forever. Checked here, where torch's
    # agent is loaded anyway (the schema cannot import it: see EXIT_BARRIER_KEY).
    names = exit_barrier_names()
    if names != (EXIT_BARRIER_PREFIX, EXIT_BARRIER_KEY):
        raise ImportError(f"this torch names its exit barrier {names[0]!r} (last member {names[1]!r}); "
                          f"lightning_ft knows {EXIT_BARRIER_KEY!r} and does not support it")

BACKEND_NAME = "lightning_ft"


class LightningFTRendezvousHandler(RendezvousHandler):
    """Adapts :class:`BarrierRendezvous` to torch's elastic agent.

    Standby nodes stay inside :meth:`next_rendezvous` until a failure needs them; they leave
    with ``RendezvousGracefulExitError`` when the job finished or closed for good.

    The agent records what it sees in the run's event log (``events``; ``lightning-ft report``
    reads it): every round it completes (standby ones too), each re-rendezvous after an active
    round as a failure (torch's agent comes back only when its workers failed or the membership
    changed) and how it left. The workers' own events come from the workers.
    """

    def __init__(self, participant: Participant, local_addr: str | None = None,
                 health_check: Callable[[], tuple[bool, str]] | None = None,
                 events: EventLog | NullEventLog | None = None) -> None:
        self._participant = participant
        self._rdzv = participant.rendezvous
        self._local_addr = local_addr
        self._health_check = health_check
        self._shut_down = False
        self._left_gracefully = False
        self._events = events if events is not None else NullEventLog()
        self._rdzv.on_round_complete.append(self._round_complete)

    def _round_complete(self, result: RoundResult) -> None:
        self._events.emit(ev.ROUND_COMPLETE, round=result.round, rank=result.rank, world=result.world_size,
                          standby=not result.is_active)

    @property
    def rendezvous(self) -> BarrierRendezvous:
        return self._rdzv

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        # Workers get their own store on rank 0 of each round, so a restarted worker group
        # never meets keys of the previous one.
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._next_rendezvous()
        except RendezvousGracefulExitError:
            self._left_gracefully = True
            raise

    def _next_rendezvous(self) -> RendezvousInfo:
        if self._health_check is not None:
            healthy, reasons = self._health_check()
            if not healthy:
                self._rdzv.report_unhealthy(reasons)
                raise UnhealthyNodeError(
                    f"node {self._rdzv.participant_id} failed its health check and is excluded: {reasons}")
        last = self._rdzv.last_result
        if last is not None and last.is_active:
            self._events.emit(ev.FAILURE_DETECTED, round=last.round, step=None, detector="agent",
                              error="torchrun's agent restarts its workers (a worker failed, or the membership "
                                    "changed)")
            self._participant.backend.follow_newest()  # the others may have moved while this agent was frozen
        result = self._rdzv.next_active_round()
        round_store = dist.PrefixStore(result.store_prefix, raw_store(self._rdzv.store))
        bootstrap = RendezvousStoreInfo.build(result.rank, round_store, local_addr=self._local_addr)
        return RendezvousInfo(round_store, result.rank, result.world_size, bootstrap)

    def is_closed(self) -> bool:
        return self._rdzv.is_closed()

    def set_closed(self) -> None:
        self._rdzv.close_for_good(CloseReason(CloseKind.CLOSED, "closed by set_closed()"))

    def num_nodes_waiting(self) -> int:
        return self._rdzv.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._rdzv.settings.run_id

    def shutdown(self) -> bool:
        """Called by torch's launcher when the agent ends (not after a death signal).

        If this node's workers finished and passed the exit barrier, the job is done: close
        the rendezvous for good (so spares exit) and acknowledge. If this node failed, it
        leaves the job and the others re-form without it.
        """
        if self._shut_down:
            return True
        self._shut_down = True
        if self._left_gracefully:
            self._events.emit(ev.SPARE_EXIT, reason="not needed: the job finished or closed")
            done = self._rdzv.shutdown(job_finished=False)
            _exit_zero_if_torch_mishandles_graceful_exit()
            return done
        result = self._rdzv.last_result
        try:
            finished = result is not None and result.is_active and self._rdzv.finished_round(result.round)
            if result is not None and result.is_active and not finished and not self._rdzv.is_closed():
                self._rdzv.withdraw("its workers failed and it gave up (restarts exhausted or error)")
                if self._rdzv.is_store_host:
                    log.warning("the store host is leaving; the store fails over to another node%s",
                                "" if self._participant.backend.name == "failover" else
                                " -- not here (store_failover=false): the other nodes lose it")
        except (RuntimeError, OSError) as exc:
            log.warning("rendezvous shutdown could not reach the store: %s", exc)
            return False
        if result is not None and result.is_active:
            self._events.emit(ev.AGENT_EXIT, round=result.round, outcome="finished" if finished else "gave_up",
                              reason="its workers finished" if finished else
                              "its workers failed and it gave up (restarts exhausted or error)")
        return self._rdzv.shutdown(job_finished=finished)


def _exit_zero_if_torch_mishandles_graceful_exit() -> None:
    # torch 2.13: after RendezvousGracefulExitError, SimpleElasticAgent.run() returns None and
    # launch_agent then calls None.is_failed(); the AttributeError makes torchrun exit 1 for a
    # spare that was simply not needed. launch_agent calls shutdown() from its ``finally``
    # while that error is in flight: replace it with a clean exit, and nothing else.
    # It leaves with os._exit: an ordinary interpreter exit here aborted about 1 run in 8 on a
    # loaded machine ("terminate called without an active exception", status -6), a C++ thread
    # of the agent still joinable during static destruction. Everything this node had to do
    # is done: shutdown() acknowledged (and, hosting the store, waited for the others).
    exc = sys.exc_info()[1]
    if isinstance(exc, AttributeError) and "is_failed" in str(exc):
        log.info("standby node leaves with exit status 0 (not needed; torch's launcher would "
                 "report a spurious failure here)")
        exit_now(0)


def create_handler(params: RendezvousParameters) -> LightningFTRendezvousHandler:
    """Build the handler from torch's ``RendezvousParameters`` (``--rdzv-conf`` keys as config)."""
    ensure_log_output()
    _check_torch_exit_barrier_key()
    try:
        job_signer()
    except SecretError as exc:
        raise RendezvousConfigError(str(exc)) from None
    options, settings = torchrun_config(params.run_id, params.min_nodes, params.max_nodes, params.config)
    endpoint = parse_endpoint(params.endpoint)
    # bounded like every store connection of ours: a frozen store makes a call fail after
    # store_timeout (the agent then ends truthfully) instead of blocking the agent for good
    info = local_participant(local_id=options.local_id, domain_id=options.domain_id,
                             infra_rank=options.infra_rank, addr=params.local_addr)
    participant = open_participant(endpoint, options.is_host, info, settings)
    health_check = _node_health_check(settings.timeouts.health_timeout) if settings.health_check else None
    events = open_event_log(info.participant_id)
    events.emit(ev.JOIN, participant=info.participant_id, domain=info.domain_id, endpoint=str(endpoint),
                run_id=settings.run_id, min_nodes=settings.min_nodes, max_nodes=settings.max_nodes,
                store_host=participant.hosting, launcher="torchrun")
    log.info("lightning_ft rendezvous: run %s, nodes %d:%d, endpoint %s, %s, participant %s (domain %s)",
             settings.run_id, settings.min_nodes, settings.max_nodes, endpoint,
             "store host" if participant.hosting else "store client", info.participant_id, info.domain_id)
    return LightningFTRendezvousHandler(participant, params.local_addr, health_check, events)


def _node_health_check(timeout_s: float) -> Callable[[], tuple[bool, str]]:
    from lightning_ft.health import NodeHealthCheck  # imported only when asked for

    check = NodeHealthCheck(timeout_s=timeout_s)

    def run() -> tuple[bool, str]:
        report = check.run()
        return report.healthy, "; ".join(report.reasons)

    return run


def torchrun_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point for ``torchrun.handlers``: torch calls it and registers what it returns."""
    return create_handler


__all__ = [
    "BACKEND_NAME",
    "LightningFTRendezvousHandler",
    "RendezvousClosedError",
    "RendezvousGracefulExitError",
    "create_handler",
    "torchrun_handler_creator",
]

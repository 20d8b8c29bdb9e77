"""How the training state lies across the ranks, and what follows from it for fault tolerance.

The runtime is the same for every strategy; what differs between replicated state (``ddp_ft``:
every rank holds the whole model) and sharded state (``fsdp_ft``: each rank holds only its own
shards) is decided here, in one object the strategy hands the runtime:

* which snapshot exchange forms a round (the newest snapshot to every rank, or each rank its
  own shards of the newest step whose shards all exist);
* whether the survivors' live state can be resumed after a loss (replicated: yes; sharded: the
  lost rank's shards exist only at a snapshot step);
* whether ranks keep their places (sharded: a rank's shards exist only where that rank ran);
* how copies reach other failure domains (through the store to hot spares, or over the group to
  ranks in other domains after each scheduled snapshot), whether stragglers are watched, and
  what a failed round needs before it can re-form (sharded: the module as ``fit()`` received it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning_ft._lightning.module_template import ModuleTemplate
from lightning_ft.checkpoint.exchange.agreement import gather_steps
from lightning_ft.checkpoint.exchange.shard_replicas import ShardReplicator
from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.exit_codes import JobCannotGoOn
from lightning_ft.runtime.decisions import START_OVER_NO, START_OVER_UNKNOWN, START_OVER_YES, may_start_over

log = logging.getLogger(__name__)

Emit = Callable[..., None]


class ReplicatedState:
    """Every rank holds the whole model and optimizer state (``ddp_ft``)."""

    name = "replicated"
    keeps_ranks = False
    watches_stragglers = True
    #: after a loss the survivors' live state is a complete step to resume from
    resumes_from_live_state = True
    #: hot spares receive encrypted copies of rank 0's snapshot through the store
    replicates_through_store = True
    #: a rank that stood by in a fit receives the module state when a later stage makes it active
    aligns_module_state = True

    def capture(self, module: Any) -> None:
        """Nothing to keep: the model's parameters survive a failed round."""

    def cannot_reform(self, module: Any) -> str | None:
        return None

    def rebuild(self, module: Any, device: Any) -> None:
        """Replicated parameters survive a failed round as they are."""

    def exchange(self, checkpoint: EmergencyCheckpoint, rank: int, world_size: int, emit: Emit,
                 model: str | None) -> int | None:
        """The newest snapshot any rank holds, to every rank; returns its step (None: none)."""
        plan = checkpoint.snapshots.exchange(rank, world_size, emit, model=model)
        return plan.step if plan is not None else None

    def check_resumed(self, follows_a_failure: bool, resumed: bool) -> None:
        """Any restore (or none, at the round's start snapshot) is a consistent state."""

    def start_round(self, checkpoint: EmergencyCheckpoint | None, step: int, rank: int, world_size: int,
                    domain_id: str, replication_factor: int, emit: Emit) -> None:
        """Copies for hot spares are published by the runtime (rank 0), not per rank."""

    def after_optimizer_step(self, checkpoint: EmergencyCheckpoint | None, step: int,
                             progress: Callable[[], None]) -> None:
        """Nothing after a step."""

    def can_hand_over(self) -> bool:
        """The survivors' live state holds everything a leaver had: a spare can always take its place."""
        return True

    def before_hand_over(self, checkpoint: EmergencyCheckpoint | None, trainer: Any,
                         progress: Callable[[], None]) -> None:
        """Nothing to send: the survivors' live state is the step the next round resumes from."""


class ShardedState:
    """Each rank holds only its own shards (FSDP2 ``DTensor``\\ s; ``fsdp_ft``)."""

    name = "sharded"
    keeps_ranks = True
    watches_stragglers = False
    resumes_from_live_state = False
    replicates_through_store = False
    aligns_module_state = False  # a rank's shards exist only where it trained (see docs/strategy.md)

    _one_domain_warned = False  # said once per process

    def __init__(self) -> None:
        #: the module's children as fit() received them (taken when the first round sets up)
        self._template: ModuleTemplate | None = None
        #: copies of each rank's snapshots on ranks in other failure domains (this round's)
        self._replicas: ShardReplicator | None = None
        #: whether this rank's round started from the fit's own start state (None: no round yet)
        self._round_from_fit_start: bool | None = None
        #: whether this round copies shards to other domains, and whether this rank sent one yet
        self._copies_planned = self._copied = False

    def capture(self, module: Any) -> None:
        """Before ``configure_model`` shards anything in this process: keep the children as they are."""
        if self._template is None:
            self._template = ModuleTemplate.capture(module)

    def cannot_reform(self, module: Any) -> str | None:
        if self._template is None or module is None:
            return "the module's state at fit() start was not kept (the failure came before the first round set up)"
        return self._template.rebuild_problem(module)

    def rebuild(self, module: Any, device: Any) -> None:
        """Replace the sharded children, bound to the failed round's mesh, with fresh copies as
        ``fit()`` received them; ``configure_model`` shards them on the next round's mesh and the
        snapshot gives them their values."""
        assert self._template is not None  # see cannot_reform
        self._template.rebuild(module, device)

    def exchange(self, checkpoint: EmergencyCheckpoint, rank: int, world_size: int, emit: Emit,
                 model: str | None) -> int | None:
        """Each rank its own shards of the newest step whose shards all exist; returns that step."""
        plan = checkpoint.snapshots.exchange_shards(rank, world_size, emit, model=model)
        return plan.step if plan is not None else None

    def check_resumed(self, follows_a_failure: bool, resumed: bool) -> None:
        """After a failure no step had every rank's shards: start over from the failed round's
        start state when every rank that trained in it can (:func:`may_start_over`; a collective:
        every rank of the round calls it with the same arguments), else end the job."""
        if follows_a_failure and not resumed:
            # the module was rebuilt without values: only a snapshot whose shards all exist gives
            # them, or the state the fit started from, which the rerun rebuilds as the first run did
            votes = [row[0] for row in gather_steps([self._start_over_vote()])]
            if not may_start_over(votes):
                raise JobCannotGoOn(
                    "fsdp_ft: after the failure no step has every rank's shards (in memory on the participants' "
                    "hosts or in the durable tier): a lost rank's shards went with its failure domain and no copy "
                    "of them survived (replication_factor, persist_to); resuming would mix steps or start over")
            log.warning("fsdp_ft: the failure came before any rank's shards were copied to another failure domain: "
                        "starting over from the state the fit started with")
        # a round that starts from the fit's own start state can be started again from it
        self._round_from_fit_start = not resumed
        self._copies_planned = self._copied = False

    def _start_over_vote(self) -> int:
        if self._round_from_fit_start is None:
            return START_OVER_UNKNOWN  # did not train in the failed round (a spare)
        # without copies (replication_factor=0, one failure domain) every loss of a host would
        # start over again: the job ends instead and says why (the configuration decided it)
        fresh = self._round_from_fit_start and self._copies_planned and not self._copied
        return START_OVER_YES if fresh else START_OVER_NO

    def start_round(self, checkpoint: EmergencyCheckpoint | None, step: int, rank: int, world_size: int,
                    domain_id: str, replication_factor: int, emit: Emit) -> None:
        """Plan this round's copies of each rank's shards on ranks in other failure domains, and
        copy the snapshot of the round's start ``step`` at once (collective): until a rank's
        shards have a copy, losing its domain loses every step."""
        self._replicas = None
        if checkpoint is None or not replication_factor or world_size < 2:
            return
        replicas = ShardReplicator(checkpoint.snapshots.open_store_for, rank, world_size, domain_id,
                                   replication_factor, emit)
        if not replicas.copies and not ShardedState._one_domain_warned and rank == 0:
            ShardedState._one_domain_warned = True
            log.warning("fsdp_ft: every rank is in one failure domain (%s), so no rank's shards are copied to "
                        "another; losing it loses the shards of every step (set LIGHTNING_FT_DOMAIN_ID per host, "
                        "or keep durable copies with persist_to)", domain_id)
        self._replicas = replicas if replicas.copies else None
        self._copies_planned = self._replicas is not None
        if self._replicas is not None:
            store = checkpoint.store
            start = next((info for info in store.list() if info.step == step), None) if store is not None else None
            self._copy(start, store)

    def after_optimizer_step(self, checkpoint: EmergencyCheckpoint | None, step: int,
                             progress: Callable[[], None]) -> None:
        """The snapshot of ``step`` (scheduled, or the budget's first measured save) was committed
        before this update (the optimizer's pre-hook): copy it now, every rank at the same step,
        before the next snapshot is taken."""
        if self._replicas is not None and checkpoint is not None and checkpoint.snapshot_step(step):
            progress()
            self._copy(checkpoint.last_snapshot, checkpoint.store)
            progress()

    def can_hand_over(self) -> bool:
        """A leaver's shards reach its replacement only as a copy in another failure domain."""
        return self._replicas is not None

    def before_hand_over(self, checkpoint: EmergencyCheckpoint | None, trainer: Any,
                         progress: Callable[[], None]) -> None:
        """At the hand-over's step boundary, on every rank (the leavers too, which are alive and hold
        their shards): snapshot this step's shards and copy them to ranks in other failure domains
        (collective), so the next round resumes at this step -- the leavers' shards from their
        copies -- and no step is trained again."""
        if self._replicas is None or checkpoint is None:
            return
        progress()
        own = checkpoint.last_snapshot
        if own is None or own.step != trainer.global_step:
            try:
                own = checkpoint.save_now(trainer, reason="hand-over")
            except Exception:  # the copy says "nothing" and the newest complete step stands
                log.exception("fsdp_ft: the hand-over's snapshot of step %d failed", trainer.global_step)
                own = None
        self._copy(own, checkpoint.store)
        progress()

    def _copy(self, own: SnapshotInfo | None, store: SnapshotStore | None) -> None:
        assert self._replicas is not None
        self._copied = self._replicas.copy(own, store) or self._copied


StateLayout = ReplicatedState | ShardedState

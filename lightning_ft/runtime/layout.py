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
from lightning_ft.checkpoint.exchange.shard_replicas import ShardReplicator
from lightning_ft.checkpoint.lightning.callback import EmergencyCheckpoint
from lightning_ft.exit_codes import JobCannotGoOn

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

    def start_round(self, checkpoint: EmergencyCheckpoint | None, rank: int, world_size: int, domain_id: str,
                    replication_factor: int, emit: Emit) -> None:
        """Copies for hot spares are published by the runtime (rank 0), not per rank."""

    def after_optimizer_step(self, checkpoint: EmergencyCheckpoint | None, step: int,
                             progress: Callable[[], None]) -> None:
        """Nothing after a step."""


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
        if follows_a_failure and not resumed:
            # the module was rebuilt without values: only a snapshot whose shards all exist gives them
            raise JobCannotGoOn(
                "fsdp_ft: after the failure no step has every rank's shards (in memory on the participants' hosts "
                "or in the durable tier): a lost rank's shards went with its failure domain and no copy of them "
                "survived (replication_factor, persist_to); resuming would mix steps or start over")

    def start_round(self, checkpoint: EmergencyCheckpoint | None, rank: int, world_size: int, domain_id: str,
                    replication_factor: int, emit: Emit) -> None:
        """Plan this round's copies of each rank's shards on ranks in other failure domains."""
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

    def after_optimizer_step(self, checkpoint: EmergencyCheckpoint | None, step: int,
                             progress: Callable[[], None]) -> None:
        """The snapshot of a scheduled step was committed before this update (the optimizer's
        pre-hook): copy it now, every rank at the same step."""
        replicas = self._replicas
        if replicas is not None and checkpoint is not None and checkpoint.scheduled(step):
            progress()
            replicas.copy(checkpoint.last_snapshot, checkpoint.store)
            progress()


StateLayout = ReplicatedState | ShardedState

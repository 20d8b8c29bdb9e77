"""Barrier rendezvous with hot spares over a ``torch.distributed.Store`` (no Lightning import).

Pure protocol: rounds, ranks, hot spares, heartbeats (:mod:`.liveness`), closing for good. Where
the store lives and whether it fails over is the backend's (:mod:`lightning_ft.store.backend`);
how a process becomes a participant is :mod:`lightning_ft.launch`'s.
"""

# torch's rendezvous package loads out-of-tree backends (ours: lightning_ft.launch.torchrun,
# which imports this package) while it initializes.
# Import it before our modules so that load finds this package's modules complete, not
# half-initialized (which would make torch skip our backend with an ImportError).
import torch.distributed.elastic.rendezvous  # noqa: F401  isort: skip

from lightning_ft.rendezvous.barrier import (
    BarrierRendezvous,
    ExtraParticipantError,
    ParticipantExcludedError,
    RoundResult,
    UnhealthyNodeError,
)
from lightning_ft.rendezvous.participant import ParticipantInfo, local_participant
from lightning_ft.rendezvous.settings import (
    RendezvousConfigError,
    RendezvousOptions,
    RendezvousSettings,
    settings_from_config,
)

__all__ = [
    "BarrierRendezvous",
    "ExtraParticipantError",
    "ParticipantExcludedError",
    "ParticipantInfo",
    "RendezvousConfigError",
    "RendezvousSettings",
    "RendezvousOptions",
    "RoundResult",
    "UnhealthyNodeError",
    "local_participant",
    "settings_from_config",
]

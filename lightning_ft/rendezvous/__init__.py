"""Barrier rendezvous with hot spares over a ``torch.distributed.Store`` (no Lightning import)."""

# torch's rendezvous package loads out-of-tree backends (ours: .handler) while it initializes.
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
from lightning_ft.rendezvous.participant import ParticipantInfo, detect_infra_rank, local_participant
from lightning_ft.rendezvous.settings import RendezvousConfigError, RendezvousSettings, settings_from_config

__all__ = [
    "BarrierRendezvous",
    "ExtraParticipantError",
    "ParticipantExcludedError",
    "ParticipantInfo",
    "RendezvousConfigError",
    "RendezvousSettings",
    "RoundResult",
    "UnhealthyNodeError",
    "detect_infra_rank",
    "local_participant",
    "settings_from_config",
]

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
from lightning_ft.rendezvous.participant import ParticipantInfo, local_participant
from lightning_ft.rendezvous.settings import (
    RendezvousConfigError,
    RendezvousOptions,
    RendezvousSettings,
    settings_from_config,
)
from lightning_ft.rendezvous.store import DEFAULT_PORT, Endpoint, connect_store, parse_endpoint

__all__ = [
    "DEFAULT_PORT",
    "BarrierRendezvous",
    "Endpoint",
    "ExtraParticipantError",
    "ParticipantExcludedError",
    "ParticipantInfo",
    "RendezvousConfigError",
    "RendezvousSettings",
    "RendezvousOptions",
    "RoundResult",
    "UnhealthyNodeError",
    "connect_store",
    "local_participant",
    "parse_endpoint",
    "settings_from_config",
]

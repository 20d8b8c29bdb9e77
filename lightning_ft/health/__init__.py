"""Node-health probes: is this node fit to write an emergency checkpoint?

``NodeHealthCheck().run()`` runs the built-in probes (host shutdown marker, accelerator,
free memory, free disk, optional marker files and an external command) in threads under
one deadline and returns a :class:`HealthReport`. No Lightning import.
"""

from lightning_ft.health.check import HealthReport, NodeHealthCheck
from lightning_ft.health.probes import (
    AcceleratorProbe,
    CommandProbe,
    DiskSpaceProbe,
    MarkerFileProbe,
    MemoryProbe,
    Probe,
    ProbeResult,
    ShutdownMarkerProbe,
    default_probes,
)
from lightning_ft.health.settings import HealthSettings

__all__ = [
    "AcceleratorProbe", "CommandProbe", "DiskSpaceProbe", "HealthReport", "MarkerFileProbe",
    "MemoryProbe", "NodeHealthCheck", "Probe", "ProbeResult", "ShutdownMarkerProbe", "default_probes", "HealthSettings",
]

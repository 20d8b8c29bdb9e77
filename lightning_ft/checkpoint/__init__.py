"""Emergency in-memory checkpoints: crash-consistent snapshots in host shared memory.

``SnapshotStore``/``SnapshotInfo`` do not import Lightning (usable from launchers and
agents); ``MemoryCheckpointIO`` and ``EmergencyCheckpoint`` load it on first use.
"""

from __future__ import annotations

from lightning_ft._lazy import lazy_getattr
from lightning_ft.checkpoint.identity import ExpectedIdentity, SnapshotIdentity
from lightning_ft.checkpoint.memory.format import SnapshotError
from lightning_ft.checkpoint.memory.listing import SnapshotInfo
from lightning_ft.checkpoint.memory.store import SnapshotStore

_LAZY = {
    "MemoryCheckpointIO": "lightning_ft.checkpoint.lightning.io",
    "EmergencyCheckpoint": "lightning_ft.checkpoint.lightning.callback",
}

__all__ = ["SnapshotStore", "SnapshotInfo", "SnapshotError", "SnapshotIdentity", "ExpectedIdentity", *_LAZY]

__getattr__ = lazy_getattr("lightning_ft.checkpoint", _LAZY, globals())

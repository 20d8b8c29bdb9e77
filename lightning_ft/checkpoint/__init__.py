"""Emergency in-memory checkpoints: crash-consistent snapshots in host shared memory.

``SnapshotStore``/``SnapshotInfo`` do not import Lightning (usable from launchers and
agents); ``MemoryCheckpointIO`` and ``EmergencyCheckpoint`` load it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_ft.checkpoint.snapshot_format import SnapshotError
from lightning_ft.checkpoint.store import SnapshotInfo, SnapshotStore

_LAZY = {
    "MemoryCheckpointIO": "lightning_ft.checkpoint.io",
    "EmergencyCheckpoint": "lightning_ft.checkpoint.callback",
}

__all__ = ["SnapshotStore", "SnapshotInfo", "SnapshotError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_ft.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

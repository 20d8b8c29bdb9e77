"""``Trainer(strategy="ddp_ft")``: DDP with a barrier rendezvous, hot spares and in-process recovery.

See :mod:`lightning_ft.strategy.strategy` for how a process runs ``fit()`` and recovers,
:mod:`lightning_ft.strategy.timeline` for the events it logs, and
:mod:`lightning_ft.strategy.decisions` for the rules it follows. Importing this package is
cheap; the Lightning-facing names load on first use (the pure modules stay Lightning-free).
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_ft.strategy.config import StrategyConfigError

_LAZY = {
    "FaultTolerantDDPStrategy": "lightning_ft.strategy.strategy",
    "NoRestartError": "lightning_ft.strategy.strategy",
    "register_strategy": "lightning_ft.strategy.strategy",
}

__all__ = ["FaultTolerantDDPStrategy", "NoRestartError", "StrategyConfigError", "register_strategy"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_ft.strategy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

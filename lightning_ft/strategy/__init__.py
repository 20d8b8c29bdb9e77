"""``Trainer(strategy="ddp_ft")``: DDP with a barrier rendezvous, hot spares and in-process recovery.

The strategy (:mod:`.strategy`) is the Lightning surface; :mod:`.launcher` runs ``fit()``
round by round, :mod:`.recovery` handles a failed round, :mod:`.session` holds the state of
the session and of the round, :mod:`.decisions` holds the rules as pure functions and
:mod:`.settings` the validated settings. Importing this package is cheap; the
Lightning-facing names load on first use (the pure modules stay Lightning-free).
"""

from __future__ import annotations

from lightning_ft._lazy import lazy_getattr
from lightning_ft.strategy.settings import StrategyConfigError

_LAZY = {
    "FaultTolerantDDPStrategy": "lightning_ft.strategy.strategy",
    "FaultTolerantFSDPStrategy": "lightning_ft.strategy.fsdp",
    "register_strategy": "lightning_ft.strategy.strategy",
}

__all__ = ["FaultTolerantDDPStrategy", "FaultTolerantFSDPStrategy", "StrategyConfigError", "register_strategy"]

__getattr__ = lazy_getattr("lightning_ft.strategy", _LAZY, globals())

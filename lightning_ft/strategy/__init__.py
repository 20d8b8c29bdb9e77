"""``Trainer(strategy="ddp_ft")`` and ``Trainer(strategy="fsdp_ft")``: Lightning's ``DDPStrategy`` and
``ModelParallelStrategy``, each holding the fault-tolerance runtime (:mod:`lightning_ft.runtime`).

:mod:`.ddp` and :mod:`.fsdp` are the two strategies, :mod:`.surface` the hooks they share and
:mod:`.environment` the cluster environments (ranks from the round). Importing this package is
cheap; the Lightning-facing names load on first use.
"""

from __future__ import annotations

from lightning_ft._lazy import lazy_getattr

_LAZY = {
    "StrategyConfigError": "lightning_ft.runtime.settings",
    "FaultTolerantDDPStrategy": "lightning_ft.strategy.ddp",
    "FaultTolerantFSDPStrategy": "lightning_ft.strategy.fsdp",
    "register_strategy": "lightning_ft.strategy.ddp",
}

__all__ = ["FaultTolerantDDPStrategy", "FaultTolerantFSDPStrategy", "StrategyConfigError", "register_strategy"]

__getattr__ = lazy_getattr("lightning_ft.strategy", _LAZY, globals())

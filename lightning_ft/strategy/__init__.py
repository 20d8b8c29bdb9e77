"""``Trainer(strategy="ddp_ft")``: DDP with a barrier rendezvous, hot spares and in-process recovery.

See :mod:`lightning_ft.strategy.strategy` for how a process runs ``fit()`` and recovers,
:mod:`lightning_ft.strategy.timeline` for the events it logs, and
:mod:`lightning_ft.strategy.decisions` for the rules it follows.
"""

from lightning_ft.strategy.config import StrategyConfigError
from lightning_ft.strategy.strategy import FaultTolerantDDPStrategy, NoRestartError, register_strategy

__all__ = ["FaultTolerantDDPStrategy", "NoRestartError", "StrategyConfigError", "register_strategy"]

"""lightning_ft: fault-tolerant distributed training for PyTorch Lightning.

``import lightning_ft`` is cheap: it does not import Lightning. The Lightning-facing
names are loaded on first use, and the ``ddp_ft`` strategy is registered with
Lightning's ``StrategyRegistry`` as soon as ``lightning.pytorch`` is imported (before
or after this package), so ``Trainer(strategy="ddp_ft")`` works either way. This keeps
the torchrun agent, which loads our rendezvous backend, free of the Lightning import.
"""

from __future__ import annotations

from lightning_ft._lazy import lazy_getattr
from lightning_ft.exit_codes import ExitCode, FaultTolerantExit, JobEndedError
from lightning_ft.strategy.registration import register_when_lightning_loads

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily; these import Lightning)
_LAZY_NAMES = {
    "GracefulTermination": "lightning_ft.termination.callback",
    "EmergencyCheckpoint": "lightning_ft.checkpoint.lightning.callback",
    "FaultTolerantDDPStrategy": "lightning_ft.strategy",
    "FaultTolerantFSDPStrategy": "lightning_ft.strategy",
}

__all__ = ["ExitCode", "FaultTolerantExit", "JobEndedError", "__version__", *_LAZY_NAMES]

__getattr__ = lazy_getattr("lightning_ft", _LAZY_NAMES, globals())


register_when_lightning_loads()

"""Register the ``ddp_ft`` and ``fsdp_ft`` strategies with Lightning without importing Lightning early.

``import lightning_ft`` installs an import watcher; as soon as ``lightning.pytorch`` has
loaded (before or after this package), ``ddp_ft`` is registered and the known-harmless
Lightning/torch warnings are filtered (:mod:`lightning_ft._lightning.compat`).

What is registered is a factory, :func:`create_ddp_ft`, not the class: importing the
strategy module at that moment would import our callbacks, which may be the very modules
whose ``import lightning.pytorch`` triggered the watcher (a circular import). The factory
imports the strategy when Lightning first builds one, by which time every import is done.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from lightning_ft._lightning.compat import silence_known_warnings
from lightning_ft._lightning.names import (
    FSDP_STRATEGY_DESCRIPTION,
    FSDP_STRATEGY_NAME,
    STRATEGY_DESCRIPTION,
    STRATEGY_NAME,
)
from lightning_ft._lightning.slurm import install as install_slurm_compat

# The whole package, not ``lightning.pytorch.strategies``: that one loads while
# ``lightning.pytorch`` is still half-initialized. The registry is read only when a Trainer
# is built, later.
_TRIGGER_MODULE = "lightning.pytorch"


def create_ddp_ft(**kwargs: Any) -> Any:
    """What ``StrategyRegistry.get("ddp_ft")`` calls: a ``FaultTolerantDDPStrategy`` from its settings."""
    from lightning_ft.strategy.ddp import FaultTolerantDDPStrategy  # on first use (module docstring)

    return FaultTolerantDDPStrategy(**kwargs)


def create_fsdp_ft(**kwargs: Any) -> Any:
    """What ``StrategyRegistry.get("fsdp_ft")`` calls: a ``FaultTolerantFSDPStrategy`` (see :func:`create_ddp_ft`)."""
    from lightning_ft.strategy.fsdp import FaultTolerantFSDPStrategy  # on first use (module docstring)

    return FaultTolerantFSDPStrategy(**kwargs)


def _register_strategy() -> None:
    silence_known_warnings()
    # loaded by now: this runs once lightning.pytorch has finished importing
    from lightning.pytorch.strategies import StrategyRegistry

    for name, factory, description in ((STRATEGY_NAME, create_ddp_ft, STRATEGY_DESCRIPTION),
                                       (FSDP_STRATEGY_NAME, create_fsdp_ft, FSDP_STRATEGY_DESCRIPTION)):
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, factory, description=description)
        install_slurm_compat(factory)  # under srun, Lightning's SLURM checks would reject our layouts


class _LoaderThatRegistersAfterwards(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:  # the importlib loader protocol
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _register_strategy()


def spec_that_registers() -> ModuleSpec | None:
    """The spec of ``lightning.pytorch`` whose loading registers our strategies once it is done
    (for an import of it under way: the watcher below, and the startup hook of an installed
    package, ``_lightning_ft_startup``). Takes every watcher of ours off ``sys.meta_path``."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _LightningImportWatcher)]
    spec = importlib.util.find_spec(_TRIGGER_MODULE)
    if spec is None or spec.loader is None:
        return spec
    spec.loader = _LoaderThatRegistersAfterwards(spec.loader)
    return spec


class _LightningImportWatcher(importlib.abc.MetaPathFinder):
    """Waits for ``lightning.pytorch`` to load, then registers ``ddp_ft``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _TRIGGER_MODULE:
            return None
        return spec_that_registers()


def register_when_lightning_loads() -> None:
    if _TRIGGER_MODULE in sys.modules:
        _register_strategy()
        return
    if not any(isinstance(f, _LightningImportWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningImportWatcher())

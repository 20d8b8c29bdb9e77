"""Register the ``ddp_ft`` strategy with Lightning without importing Lightning early."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

log = logging.getLogger(__name__)

_TRIGGER_MODULE = "lightning.pytorch.strategies"


def _register_strategy() -> None:
    try:
        module = importlib.import_module("lightning_ft.strategy")
    except ModuleNotFoundError as exc:  # strategy not built yet, or Lightning missing
        log.debug("ddp_ft strategy not registered: %s", exc)
        return
    register = getattr(module, "register_strategy", None)
    if register is not None:
        register()
        from lightning_ft import _slurm_compat  # under srun, Lightning's SLURM checks would reject ddp_ft layouts
        _slurm_compat.install(module.FaultTolerantDDPStrategy)


class _LoaderThatRegistersAfterwards(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):  # noqa: D401 - importlib protocol
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _register_strategy()


class _LightningImportWatcher(importlib.abc.MetaPathFinder):
    """Waits for ``lightning.pytorch.strategies`` to load, then registers ``ddp_ft``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _LoaderThatRegistersAfterwards(spec.loader)
        return spec


def register_when_lightning_loads() -> None:
    if _TRIGGER_MODULE in sys.modules:
        _register_strategy()
        return
    if not any(isinstance(f, _LightningImportWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _LightningImportWatcher())

"""Startup hook of the installed lightning-ft package: ``strategy="ddp_ft"`` without ``import lightning_ft``.

The package installs ``lightning_ft-startup.pth``, whose one line imports this module when
Python starts. It only puts a watcher on ``sys.meta_path`` (no import of lightning_ft, torch or
Lightning: every Python process of the environment pays for this module alone); the first
``import lightning.pytorch`` then loads lightning_ft's registration, so an unchanged script or
``LightningCLI`` accepts ``--trainer.strategy=ddp_ft``. ``LIGHTNING_FT_AUTOLOAD=0`` turns it off.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_TRIGGER_MODULE = "lightning.pytorch"


class _StartupWatcher(importlib.abc.MetaPathFinder):
    """On the first import of ``lightning.pytorch``: hand it lightning_ft's registering spec."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _TRIGGER_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            from lightning_ft.strategy.registration import spec_that_registers
        except ImportError:  # the package was removed but this hook was left behind: stay out of the way
            return None
        return spec_that_registers()


def install() -> None:
    """Put the watcher on ``sys.meta_path`` (once; not when ``LIGHTNING_FT_AUTOLOAD=0``, nor when
    Lightning is loaded already)."""
    if os.environ.get("LIGHTNING_FT_AUTOLOAD", "1") == "0" or _TRIGGER_MODULE in sys.modules:
        return
    if not any(isinstance(f, _StartupWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _StartupWatcher())

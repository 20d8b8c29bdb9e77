"""Startup hook of the installed lightning-ft package: ``strategy="ddp_ft"`` without ``import lightning_ft``.

The package installs ``lightning_ft-startup.pth`` into site-packages. Its one line runs when an
interpreter of the environment starts and costs a few microseconds: it imports nothing (``os``
and ``sys`` are loaded already), reads ``LIGHTNING_FT_AUTOLOAD``, and puts a watcher on
``sys.meta_path`` -- an object made in that line, so no module named on ``sys.path`` (a
``PYTHONPATH`` entry, the current directory) is imported at startup. It does nothing in an
isolated interpreter (``python -I``), with ``LIGHTNING_FT_AUTOLOAD=0``, or when Lightning is loaded
already. The first ``import lightning.pytorch`` then imports this module, whose
:func:`registering_spec` loads lightning_ft's registration: ``ddp_ft`` and ``fsdp_ft`` join
Lightning's strategy registry, and Lightning's cluster-environment detection is skipped for a
Trainer given one of these names (see ``lightning_ft/_lightning/slurm.py``; every other strategy
is detected unchanged). To remove the hook: ``LIGHTNING_FT_AUTOLOAD=0`` (then ``import
lightning_ft`` registers the strategies), or delete ``lightning_ft-startup.pth`` from
site-packages.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

_TRIGGER_MODULE = "lightning.pytorch"


def registering_spec(watcher: object) -> ModuleSpec | None:
    """What the startup watcher answers for ``lightning.pytorch``: the watcher leaves
    ``sys.meta_path``, and lightning_ft's spec that registers the strategies once Lightning has
    loaded is returned (None -- Python's own finders load it -- when lightning_ft is gone)."""
    if watcher in sys.meta_path:
        sys.meta_path.remove(watcher)
    try:
        from lightning_ft.strategy.registration import spec_that_registers
    except ImportError:  # the package was removed but its hook was left behind: stay out of the way
        return None
    return spec_that_registers()


class _StartupWatcher:
    """The watcher for a ``.pth`` line of an earlier version that called :func:`install`."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return registering_spec(self) if fullname == _TRIGGER_MODULE else None


def install() -> None:
    """What the ``.pth`` line does, for a line of an earlier version that calls this."""
    import os

    if os.environ.get("LIGHTNING_FT_AUTOLOAD", "1") == "0" or sys.flags.isolated or _TRIGGER_MODULE in sys.modules:
        return
    if not any(isinstance(f, _StartupWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _StartupWatcher())

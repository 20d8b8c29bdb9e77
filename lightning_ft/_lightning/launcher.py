"""The launcher Lightning calls in place of its own: it hands ``fit()`` to the runtime's fit loop.

Lightning's ``_Launcher`` interface is private API; this adapter is the only class built on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from lightning.pytorch.strategies.launchers.launcher import _Launcher


def disarm_child_observer() -> bool:
    """Under Lightning's popen ``ddp`` launcher, rank 0 runs a thread that SIGKILLs rank 0 and all
    children as soon as any child exits non-zero -- which every rank of a termination does on
    purpose (81/82/143), possibly while rank 0 is still writing its snapshot. End that thread's
    loop at its next poll; True when there was one."""
    found = False
    for thread in threading.enumerate():
        if type(thread).__name__ == "_ChildProcessObserver" and thread.is_alive():
            vars(thread)["_run"] = lambda: True  # Lightning's subclass: its loop ends at the next poll
            found = True
    return found


class FitLoop(Protocol):
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any: ...


class RuntimeLauncher(_Launcher):
    """Runs the Trainer's function in this process through ``loop`` (no child processes)."""

    def __init__(self, loop: FitLoop) -> None:
        self.loop = loop

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        return self.loop.launch(function, *args, trainer=trainer, **kwargs)

    def kill(self, signum: int) -> None:
        pass  # no child processes

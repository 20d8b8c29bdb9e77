"""The launcher Lightning calls in place of its own: it hands ``fit()`` to the runtime's fit loop.

Lightning's ``_Launcher`` interface is private API; this adapter is the only class built on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.pytorch.strategies.launchers.launcher import _Launcher


def script_can_run_again() -> bool:
    """Whether this process's script can be started again as is (a file or ``-m module``; not
    ``python -c``, a notebook or an interactive session)."""
    import os
    import sys

    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None:
        return spec.name not in ("ipykernel_launcher", "IPython")
    return bool(sys.argv) and sys.argv[0] not in ("", "-c") and os.path.isfile(sys.argv[0]) and \
        hasattr(__main__, "__file__")


def script_command() -> list[str]:
    """The command line that runs this process's script again (``python script.py ARGS`` or
    ``python -m module ARGS``), as Lightning's own ``ddp`` launcher builds it."""
    return list(_basic_subprocess_cmd())


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
    """Runs the Trainer's function in this process through ``loop`` (the processes it may start for
    ``devices=N`` are participants of their own: nothing to kill here)."""

    def __init__(self, loop: FitLoop, before_first_launch: Callable[[], Any] | None = None) -> None:
        self.loop = loop
        #: run once, before the first launch (the node's other devices=N processes start then)
        self.before_first_launch = before_first_launch

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        start, self.before_first_launch = self.before_first_launch, None
        if start is not None:
            start()
        return self.loop.launch(function, *args, trainer=trainer, **kwargs)

    def kill(self, signum: int) -> None:
        pass  # no child processes

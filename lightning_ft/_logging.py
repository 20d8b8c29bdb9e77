"""Make lightning_ft's log lines visible when the host program configured no logging, and let the
runtime's lines name the strategy the user chose (``ddp_ft: ...`` or ``fsdp_ft: ...``)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

from lightning_ft.settings.environment import log_level


def ensure_log_output() -> None:
    """Attach a stderr handler to the ``lightning_ft`` logger unless logging is set up already.

    Level from ``LIGHTNING_FT_LOG_LEVEL`` (default INFO). Programs that configure logging
    themselves (a root handler, or one on ``lightning_ft``) are left alone.
    """
    logger = logging.getLogger("lightning_ft")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"[lightning_ft %(asctime)s pid={os.getpid()} %(levelname)s] %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(log_level())
    logger.propagate = False


#: the fault-tolerant strategy this process runs under; the strategy sets it as it is built (one
#: process runs one strategy's runtime at a time)
_strategy_name = "ddp_ft"


def set_strategy_name(name: str) -> None:
    """Called by a strategy as it is built: the runtime's lines and errors begin with ``name``."""
    global _strategy_name
    _strategy_name = name


def strategy_name() -> str:
    """The name the runtime's lines and errors begin with: ``ddp_ft`` or ``fsdp_ft``."""
    return _strategy_name


class StrategyLog(logging.LoggerAdapter):
    """A module's logger for the runtime's lines: each begins with the strategy's name."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{_strategy_name}: {msg}", kwargs

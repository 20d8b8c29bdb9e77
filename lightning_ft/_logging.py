"""Make lightning_ft's log lines visible when the host program configured no logging."""

from __future__ import annotations

import logging
import os
import sys

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

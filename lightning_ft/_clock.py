"""The clock every deadline and interval of lightning_ft reads: ``time.monotonic`` as it was at import.

Tests of users' code replace ``time.monotonic`` (``unittest.mock.patch``, freezegun): Lightning's
own tests drive a fake clock through it to trigger time-based validation. Read through the time
module, that clock would expire our store deadlines at once (a "lost" store) and our calls would
use up the fake clock's ticks meant for the code under test. Held in a closure, not a module
attribute, so that tools that swap every module-level reference to the real function miss it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def _bind(real: Callable[[], float]) -> Callable[[], float]:
    def monotonic() -> float:
        """Seconds of the real monotonic clock (see the module docstring)."""
        return real()

    return monotonic


monotonic = _bind(time.monotonic)

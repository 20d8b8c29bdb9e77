"""One structured event log per run: JSON lines, one file per process, in a run directory.

Each line: ``{"t": wall-clock seconds, "mono": monotonic seconds, "pid": ..., "who": participant,
"event": name, ...fields}``. Writers append and flush every line, so a process killed with
SIGKILL loses nothing it logged before. ``lightning-ft report RUN_DIR`` merges the files.

The log is a record, never a reason to fail: :func:`open_event_log` and :meth:`EventLog.emit`
log a warning and carry on when the directory cannot be written.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ft._clock import monotonic
from lightning_ft.settings import load, setting
from lightning_ft.settings.fields import optional_path, parse_text

log = logging.getLogger(__name__)

EVENTS_DIR_ENV = "LIGHTNING_FT_EVENTS_DIR"


@dataclass(frozen=True)
class EventSettings:
    """Where the event log goes."""

    events_dir: str | None = setting(None, "run directory of the event log (one JSON-lines file per process); "
                                           "None: no event log", rule=optional_path, env=EVENTS_DIR_ENV,
                                     parse=parse_text)


class EventLog:
    """Appends events for one process to ``<run_dir>/events-<who>-<pid>.jsonl``."""

    def __init__(self, run_dir: str | os.PathLike, who: str) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.who = who
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in who)
        self.path = self.run_dir / f"events-{safe}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()
        self._warned = False

    @property
    def enabled(self) -> bool:
        return True

    def emit(self, event: str, **fields: Any) -> None:
        record = {"t": time.time(), "mono": monotonic(), "pid": os.getpid(), "who": self.who,
                  "event": event, **fields}
        line = json.dumps(record, default=str) + "\n"
        try:
            with self._lock, open(self.path, "a", encoding="utf-8") as out:
                out.write(line)
                out.flush()
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("event log %s not written (%s); events from here on may be missing", self.path, exc)


class NullEventLog:
    """Stands in when no run directory is configured."""

    who = ""
    path = None
    enabled = False

    def emit(self, event: str, **fields: Any) -> None:
        pass


def open_event_log(who: str, run_dir: str | os.PathLike | None = None) -> EventLog | NullEventLog:
    """An :class:`EventLog` in ``run_dir`` (else ``$LIGHTNING_FT_EVENTS_DIR``), or a null log.

    Never raises: an unusable directory is logged and gives a null log.
    """
    run_dir = run_dir or load(EventSettings, {}).events_dir
    if not run_dir:
        return NullEventLog()
    try:
        return EventLog(run_dir, who)
    except OSError as exc:
        log.warning("no event log in %s: %s", run_dir, exc)
        return NullEventLog()


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All events of a run directory, ordered by wall-clock time; torn last lines are skipped."""
    events = list(_iter_events(Path(run_dir)))
    events.sort(key=lambda e: e.get("t", 0.0))
    return events


def _iter_events(run_dir: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(run_dir.glob("events-*.jsonl")):
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by SIGKILL mid-write

"""One structured event log per run: JSON lines, one file per process, in a run directory.

Each line: ``{"t": wall-clock seconds, "mono": monotonic seconds, "pid": ..., "who": participant,
"event": name, ...fields}``. Writers append and flush every line, so a process killed with
SIGKILL loses nothing it logged before. ``lightning-ft report RUN_DIR`` merges the files.

The log is a record, never a reason to fail: :func:`open_event_log` and :meth:`EventLog.emit`
log a warning and carry on when the directory cannot be written. It is read back to decide the
job's exit code (``lightning-ft report --exit-code``), so its directory must be private like the
snapshot directories (:mod:`lightning_ft.private_dirs`; otherwise no event log, with a warning),
and a reader takes nothing on trust: a line that is not an event is skipped and counted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ft._clock import monotonic
from lightning_ft.private_dirs import DirPurpose, make_private_dir
from lightning_ft.settings import load, setting
from lightning_ft.settings.fields import optional_path, parse_text

log = logging.getLogger(__name__)

EVENTS_DIR_ENV = "LIGHTNING_FT_EVENTS_DIR"
EVENTS_DIR_PURPOSE = DirPurpose("event lines (the job's exit code is read from them)",
                                "another events directory (LIGHTNING_FT_EVENTS_DIR)")
#: a longer line is not one this package wrote (errors are cut far shorter)
MAX_EVENT_LINE_BYTES = 1 << 20


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
        make_private_dir(str(self.run_dir), "the events directory", EVENTS_DIR_PURPOSE, parents=True)
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
    except (OSError, ValueError) as exc:  # ValueError: a directory another user could write
        log.warning("no event log in %s: %s", run_dir, exc)
        return NullEventLog()


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All events of a run directory, ordered by wall-clock time; lines that are not events are
    skipped (see :func:`read_events_counted`)."""
    return read_events_counted(run_dir)[0]


def read_events_counted(run_dir: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """All events of a run directory, ordered by wall-clock time, and how many lines were skipped
    as not events: one torn by SIGKILL mid-write, or one nobody here wrote (not UTF-8, not a JSON
    object with an ``event`` name and a finite time ``t``, nested or numbered past what JSON here
    parses, over :data:`MAX_EVENT_LINE_BYTES`)."""
    events: list[dict[str, Any]] = []
    skipped = 0
    for path in sorted(Path(run_dir).glob("events-*.jsonl")):
        with open(path, "rb") as lines:
            for line in lines:
                event = parse_event_line(line)
                if event is None:
                    skipped += line.strip() != b""
                else:
                    events.append(event)
    events.sort(key=lambda e: float(e["t"]))
    return events, skipped


def parse_event_line(line: bytes) -> dict[str, Any] | None:
    """The event a line of an events file holds, or None when it holds none (see
    :func:`read_events_counted`)."""
    if len(line) > MAX_EVENT_LINE_BYTES:
        return None
    try:
        event = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError, too many digits
        return None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    t = event.get("t")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        return None
    return event

"""The run's event log: writing it (:mod:`.log`) and every event name (:mod:`.names`). No
Lightning, no torch; ``lightning-ft report`` reads it (:mod:`lightning_ft.report`)."""

from lightning_ft.events.log import EVENTS_DIR_ENV, EventLog, NullEventLog, open_event_log, read_events

__all__ = ["EVENTS_DIR_ENV", "EventLog", "NullEventLog", "open_event_log", "read_events"]

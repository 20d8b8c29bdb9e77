"""The run's event log: writing it (:mod:`.log`), every event name (:mod:`.names`), and
``lightning-ft report`` (:mod:`.report`). No Lightning, no torch."""

from lightning_ft.events.log import EVENTS_DIR_ENV, EventLog, NullEventLog, open_event_log, read_events

__all__ = ["EVENTS_DIR_ENV", "EventLog", "NullEventLog", "open_event_log", "read_events"]

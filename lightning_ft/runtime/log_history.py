"""One log version per run, across its rounds and its launches (see ``_lightning/history.py``).

Rank 0 decides the versions once per launch -- an earlier launch's when this one resumes from a
snapshot and the earlier one recorded them, else Lightning's own choice -- and every rank pins
what it decided. A round that follows a failure, or the first round of a launch that continues
an earlier one, continues the history from the step training resumes at.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning_ft._lightning.history import (
    continue_history,
    mark_saved_configs,
    pin_versions,
    record_versions,
    resolve_versions,
    versioned_loggers,
    versions_of_earlier_launch,
)
from lightning_ft._logging import StrategyLog
from lightning_ft.schema.run import decode_log_versions, encode_log_versions

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})


def decide_log_versions(trainer: Any, run_id: str, resume_step: int | None) -> str:
    """Rank 0: the run's log versions, encoded for the other ranks (recorded for a later launch)."""
    loggers = versioned_loggers(trainer)
    earlier = versions_of_earlier_launch(loggers, run_id) if resume_step is not None else None
    versions = earlier if earlier is not None else resolve_versions(loggers)
    record_versions(loggers, versions, run_id)
    if earlier is not None:
        ft_log.info("run %s resumes at step %s: its logs continue in version(s) %s of the earlier launch",
                 run_id, resume_step, ", ".join(str(v) for v in earlier))
    return encode_log_versions(versions, continues_launch=earlier is not None)


def keep_log_history(trainer: Any, agreed: bytes | str | None, rank: int, resume_step: int | None,
                     follows_a_failure: bool) -> bool:
    """Every rank: pin the ``agreed`` versions (None: no logger to pin); continue the history after
    a failure or an earlier launch. Collective when it continues (the config files' check).
    Returns whether this launch continues an earlier one's logs."""
    continues = False
    if agreed is not None:
        versions, continues = decode_log_versions(agreed.encode() if isinstance(agreed, str) else agreed)
        pin_versions(versioned_loggers(trainer), versions)
    if follows_a_failure or continues:
        if resume_step is not None:
            continue_history(trainer, resume_step, is_global_zero=rank == 0)
        mark_saved_configs(trainer, trainer.strategy)
    return continues

"""Keeping a run's history across recoveries: one log version per run, continued, never restarted.

Left alone, Lightning's loggers lose history at a recovery: a participant that becomes rank 0
makes a new ``CSVLogger`` writer on the same version, which deletes ``metrics.csv``; a spare
may even resolve a different version (it lists the log directory at another moment). So:

* the version of every ``CSVLogger``/``TensorBoardLogger`` is decided once per run, by rank 0
  of the first round, and pinned on every participant of every round (:func:`pin_versions`);
  rank 0 records it next to the versions (``<root_dir>/.lightning_ft-run-<run id>``), so that a
  relaunch of the run (a requeue, a torchrun restart) that resumes from a snapshot continues the
  same version (:func:`versions_of_earlier_launch`) -- as a recovery does, below -- instead of
  starting ``version_N+1`` with the history split in two;
* after a recovery that resumes at step ``S``, the new rank 0 drops the rows the resumed run
  will log again (``step >= S``) from ``metrics.csv`` and appends to it
  (:func:`continue_history`); TensorBoard's writer gets ``purge_step=S``, so the reader hides
  the older events of those steps. Rows before ``S`` -- validation results included -- stay.
* LightningCLI's ``SaveConfigCallback`` wrote the config into that same log directory in the
  first round; after a recovery it counts as saved (:func:`mark_saved_configs`), as it would in
  the process that saved it -- else it would refuse to overwrite its own file;
* checkpoint files that ``ModelCheckpoint`` wrote after the restored snapshot belong to a
  timeline that no longer exists; the new rank 0 moves them into ``.abandoned/`` next to them
  (:func:`set_aside_abandoned_checkpoints`), so the resumed run saves under the same names a
  relaunch into a fresh directory would use, and nothing is deleted.
"""

from __future__ import annotations

import csv
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from lightning_ft._logging import StrategyLog
from lightning_ft.settings.environment import file_name_of_run

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})

Version = int | str | None
VersionedLogger = CSVLogger | TensorBoardLogger


def versioned_loggers(trainer: Any) -> list[VersionedLogger]:
    """The Trainer's loggers whose log directory has a version Lightning resolves by listing files."""
    return [logger for logger in trainer.loggers if isinstance(logger, (CSVLogger, TensorBoardLogger))]


def resolve_versions(loggers: Sequence[VersionedLogger]) -> list[Version]:
    """Each logger's version, resolving it now (call on one process only: it lists the directory)."""
    return [logger.version for logger in loggers]


def pin_versions(loggers: Sequence[VersionedLogger], versions: Sequence[Version]) -> None:
    if len(loggers) != len(versions):
        ft_log.warning("%d logger(s) but %d agreed version(s); versions left as they are", len(loggers),
                    len(versions))
        return
    for logger, version in zip(loggers, versions, strict=True):
        logger._version = version  # what the version property returns from now on, on every rank


_RECORD_PREFIX = ".lightning_ft-run-"


def _record_path(logger: VersionedLogger, run_id: str) -> str | None:
    root = logger.root_dir
    if "://" in root:  # a remote log directory (fsspec): not recorded, a relaunch starts a version
        return None
    return os.path.join(root, _RECORD_PREFIX + file_name_of_run(run_id))


def _version_dir(version: Version) -> str:
    return version if isinstance(version, str) else f"version_{version}"


def record_versions(loggers: Sequence[VersionedLogger], versions: Sequence[Version], run_id: str) -> None:
    """Rank 0: note which version each logger of run ``run_id`` uses, for a relaunch of the run."""
    for logger, version in zip(loggers, versions, strict=True):
        path = _record_path(logger, run_id)
        if path is None or version is None:
            continue
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "w") as out:
                out.write(f"{version}\n")
            os.replace(tmp, path)
        except OSError as exc:
            ft_log.warning("could not record the log version of run %s in %s (a relaunch will start a new "
                        "version): %s", run_id, path, exc)


def versions_of_earlier_launch(loggers: Sequence[VersionedLogger], run_id: str) -> list[Version] | None:
    """The versions an earlier launch of run ``run_id`` recorded for these loggers, when every one
    was recorded and its directory is still there; else None (the loggers resolve as Lightning does)."""
    found: list[Version] = []
    for logger in loggers:
        path = _record_path(logger, run_id)
        if path is None:
            return None
        try:
            with open(path) as record:
                text = record.read().strip()
        except OSError:
            return None
        version: Version = int(text) if re.fullmatch(r"[0-9]{1,9}", text) else text
        if not text or not os.path.isdir(os.path.join(logger.root_dir, _version_dir(version))):
            return None
        found.append(version)
    return found


class _ContinuingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer that appends to the run's ``metrics.csv`` instead of deleting it."""

    def __init__(self, log_dir: str, header: list[str]) -> None:
        super().__init__(log_dir)
        self.metrics_keys = list(header)

    def _check_log_dir_exists(self) -> None:
        pass  # the directory holds this run's own history: keep it


def truncate_metrics(path: str, resume_step: int) -> list[str]:
    """Drop the rows of ``path`` whose ``step`` is ``>= resume_step``; returns the header.

    Written to a temporary file and moved over the original, so a crash leaves either file.
    """
    with open(path, newline="") as source:
        reader = csv.DictReader(source)
        header = list(reader.fieldnames or [])
        kept = [row for row in reader if not _logged_at_or_after(row, resume_step)]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", newline="") as target:
        writer = csv.DictWriter(target, fieldnames=header)
        writer.writeheader()
        writer.writerows(kept)
    os.replace(tmp, path)
    return header


def _logged_at_or_after(row: dict[str, str], step: int) -> bool:
    try:
        return int(float(row.get("step") or "")) >= step
    except ValueError:
        return False  # a row without a step (hparams-only) is kept


def continue_history(trainer: Any, resume_step: int, is_global_zero: bool) -> None:
    """After a recovery that resumes at ``resume_step``: keep the logs of the steps before it."""
    for logger in versioned_loggers(trainer):
        if isinstance(logger, TensorBoardLogger):
            logger._kwargs["purge_step"] = resume_step  # used when the new rank 0 opens its writer
        elif is_global_zero and logger._experiment is None:
            path = os.path.join(logger.log_dir, ExperimentWriter.NAME_METRICS_FILE)
            header = truncate_metrics(path, resume_step) if os.path.isfile(path) else []
            logger._experiment = _ContinuingExperimentWriter(logger.log_dir, header)
            ft_log.info("continuing %s from step %d (rows of later steps dropped; they are logged again)",
                     path, resume_step)


def finalize_failed(trainer: Any) -> None:
    """What Lightning's interrupt handling does with loggers after a failure: flush and close."""
    for logger in trainer.loggers:
        try:
            logger.finalize("failed")
        except Exception as exc:  # noqa: BLE001 - a logger must not stop the recovery
            ft_log.warning("%s.finalize raised %s: %s", type(logger).__name__, type(exc).__name__, exc)


def mark_saved_configs(trainer: Any, strategy: Any) -> None:
    """Every ``SaveConfigCallback`` whose config file is already in the log dir counts as saved.

    Collective (the log dir and rank 0's answer are broadcast): call on every rank alike.
    """
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, SaveConfigCallback)
                 and cb.save_to_log_dir and not cb.overwrite]
    for callback in callbacks:
        path = os.path.join(trainer.log_dir or "", callback.config_filename)
        exists = bool(strategy.broadcast(os.path.isfile(path) if strategy.global_rank == 0 else False))
        callback.already_saved = exists


ABANDONED_DIR = ".abandoned"


def set_aside_abandoned_checkpoints(trainer: Any, snapshot_created: float) -> list[str]:
    """Move ``ModelCheckpoint`` files written after the restored snapshot (``snapshot_created``,
    wall clock) that the restored callback state does not know into ``<dirpath>/.abandoned/``.

    Call on global rank 0 only, after the snapshot was restored. Returns the moved paths.
    """
    moved: list[str] = []
    for callback in trainer.callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.dirpath or not os.path.isdir(callback.dirpath):
            continue
        known = {os.path.abspath(p) for p in (*callback.best_k_models, callback.last_model_path,
                                              callback.best_model_path, callback.kth_best_model_path) if p}
        for entry in os.scandir(callback.dirpath):
            path = os.path.abspath(entry.path)
            if (entry.is_file() and entry.name.endswith(callback.FILE_EXTENSION) and path not in known
                    and entry.stat().st_mtime > snapshot_created):
                target_dir = os.path.join(callback.dirpath, ABANDONED_DIR)
                os.makedirs(target_dir, exist_ok=True)
                os.replace(path, os.path.join(target_dir, entry.name))
                moved.append(path)
    if moved:
        ft_log.info("moved %d checkpoint file(s) written after the restored snapshot into %s/: %s",
                 len(moved), ABANDONED_DIR, ", ".join(os.path.basename(p) for p in moved))
    return moved

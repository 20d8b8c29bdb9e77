"""Where and how often snapshots are copied durably: ``persist_to`` and its ``LIGHTNING_FT_PERSIST_*`` settings."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_ft.checkpoint.pacing import DEFAULT_PERSIST_OVERHEAD, UploadPacer
from lightning_ft.checkpoint.tiers import DEFAULT_MTBF_SECONDS, daly_interval_seconds
from lightning_ft.settings import load, setting
from lightning_ft.settings.fields import mapping, number, optional_path, parse_json, parse_text

DEFAULT_MAX_MIB_PER_SECOND = 512.0
DEFAULT_PERSIST_KEEP_LAST = 2


def _finite(value: object) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return None if ok else "a number (<= 0: unbounded)"


@dataclass(frozen=True)
class DurableSettings:
    """Where and how often snapshots are copied durably (the durable tier is off without ``persist_to``)."""

    persist_to: str | None = setting(
        None, "the durable tier: a directory (local or shared filesystem) or an fsspec URL (s3://bucket/prefix, "
              "needs pip install 'lightning-ft[s3]'); None: memory only. Committed snapshots are copied there in "
              "the background, a step counts only once every rank's copy is verified, and resume falls back to it "
              "when memory lacks the step. Needs a run id. A directory must be this user's and writable by nobody "
              "else (created 0700)", rule=optional_path, env="LIGHTNING_FT_PERSIST_TO",
        parse=parse_text)
    persist_every_n_seconds: float | None = setting(
        None, "about how often a snapshot is copied durably; None: Daly's interval for the measured copy time "
              "and persist_mtbf_seconds; 0: every snapshot. Converted to a power-of-two multiple of the snapshot "
              "interval in steps, agreed at the calibration steps", rule=number(inclusive=True, allow_none=True),
        env="LIGHTNING_FT_PERSIST_EVERY_SECONDS")
    persist_mtbf_seconds: float = setting(DEFAULT_MTBF_SECONDS, "the job's mean time between failures assumed "
                                                                "for the default interval", rule=number(),
                                          env="LIGHTNING_FT_MTBF_SECONDS", advanced=True)
    persist_max_mib_per_second: float = setting(DEFAULT_MAX_MIB_PER_SECOND, "upload bandwidth bound per rank "
                                                                            "(<= 0: unbounded)", rule=_finite,
                                                env="LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND", advanced=True)
    persist_max_overhead: float = setting(
        DEFAULT_PERSIST_OVERHEAD, "share of step time that steps overlapping a durable copy may lose against the "
                                  "others: the upload bound is paced from the measured step times, starting at "
                                  "64 MiB/s and never above persist_max_mib_per_second; 0: that bound, fixed",
        rule=number(inclusive=True, below=1), env="LIGHTNING_FT_PERSIST_MAX_OVERHEAD", advanced=True)
    persist_keep_last: int = setting(DEFAULT_PERSIST_KEEP_LAST, "complete durable steps kept",
                                     rule=number(integer=True, minimum=1, inclusive=True),
                                     env="LIGHTNING_FT_PERSIST_KEEP_LAST", advanced=True)
    storage_options: Mapping[str, Any] = setting({}, "fsspec options for persist_to (e.g. {\"endpoint_url\": "
                                                     "...}); credentials come from the usual places",
                                                 rule=mapping, env="LIGHTNING_FT_PERSIST_STORAGE_OPTIONS",
                                                 parse=parse_json)

    @property
    def url(self) -> str:
        assert self.persist_to is not None
        return os.fspath(self.persist_to)

    @property
    def every_n_seconds(self) -> float | None:
        return None if self.persist_every_n_seconds is None else float(self.persist_every_n_seconds)

    @property
    def max_bytes_per_second(self) -> float | None:
        """The upload bound in bytes per second (None: unbounded)."""
        rate = self.persist_max_mib_per_second
        return rate * 2**20 if rate > 0 else None

    @property
    def keep_last(self) -> int:
        return self.persist_keep_last

    @property
    def mtbf_seconds(self) -> float:
        return float(self.persist_mtbf_seconds)

    @property
    def max_overhead(self) -> float:
        return float(self.persist_max_overhead)

    def pacer(self) -> UploadPacer | None:
        """The upload pacer these settings ask for (None: a fixed bound, or unbounded)."""
        if not self.max_overhead or not self.max_bytes_per_second:
            return None
        return UploadPacer(self.max_bytes_per_second, self.max_overhead)

    def interval_seconds(self, copy_seconds: float) -> float:
        """Seconds between durable copies: the setting, else Daly's interval for a checkpoint cost
        of one durable copy (``copy_seconds``). The copy runs in the background, so counting all
        of it as cost makes the interval longer than a strict optimum (less contention, a few
        more steps at risk when a whole job is lost at once)."""
        if self.every_n_seconds is not None:
            return self.every_n_seconds
        return daly_interval_seconds(copy_seconds, self.mtbf_seconds)


def resolve_durable_settings(persist_to: str | os.PathLike | None = None, every_n_seconds: float | None = None,
                             max_mib_per_second: float | None = None, keep_last: int | None = None,
                             storage_options: Mapping[str, Any] | None = None,
                             environ: Mapping[str, str] | None = None,
                             mtbf_seconds: float | None = None,
                             max_overhead: float | None = None) -> DurableSettings | None:
    """:class:`DurableSettings` from these arguments (None: not given) and the environment; None when
    no ``persist_to`` is set anywhere (the durable tier is off)."""
    given = {"persist_to": None if persist_to is None else os.fspath(persist_to),
             "persist_every_n_seconds": every_n_seconds, "persist_max_mib_per_second": max_mib_per_second,
             "persist_keep_last": keep_last, "storage_options": storage_options,
             "persist_mtbf_seconds": mtbf_seconds, "persist_max_overhead": max_overhead}
    settings = load(DurableSettings, {k: v for k, v in given.items() if v is not None}, env=environ,
                    error=ValueError)
    return settings if settings.persist_to else None

"""Where and how often snapshots are copied durably: ``persist_to`` and its ``LIGHTNING_FT_PERSIST_*`` settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_ft._validation import require_number
from lightning_ft.checkpoint.durable.targets import storage_options_from_env
from lightning_ft.checkpoint.tiers import (
    DEFAULT_MTBF_SECONDS,
    DEFAULT_PERSIST_OVERHEAD,
    UploadPacer,
    daly_interval_seconds,
)

ENV_PERSIST_TO = "LIGHTNING_FT_PERSIST_TO"
ENV_PERSIST_EVERY_SECONDS = "LIGHTNING_FT_PERSIST_EVERY_SECONDS"
ENV_PERSIST_MAX_MIB_PER_SECOND = "LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND"
ENV_PERSIST_KEEP_LAST = "LIGHTNING_FT_PERSIST_KEEP_LAST"
ENV_MTBF_SECONDS = "LIGHTNING_FT_MTBF_SECONDS"
ENV_PERSIST_MAX_OVERHEAD = "LIGHTNING_FT_PERSIST_MAX_OVERHEAD"

DEFAULT_MAX_MIB_PER_SECOND = 512.0
DEFAULT_PERSIST_KEEP_LAST = 2


@dataclass(frozen=True)
class DurableSettings:
    """Where and how often snapshots are copied durably (see :func:`resolve_durable_settings`)."""

    url: str
    #: seconds between durable copies; None: Daly's interval from the measured copy time and ``mtbf_seconds``
    every_n_seconds: float | None = None
    max_bytes_per_second: float | None = DEFAULT_MAX_MIB_PER_SECOND * 2**20
    keep_last: int = DEFAULT_PERSIST_KEEP_LAST
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    mtbf_seconds: float = DEFAULT_MTBF_SECONDS
    #: share of step time that steps overlapping an upload may lose (the bound is paced to keep
    #: it, ``max_bytes_per_second`` the most it may reach); 0: a fixed bound
    max_overhead: float = DEFAULT_PERSIST_OVERHEAD

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


def _env_float(env: Mapping[str, str], key: str) -> float | None:
    raw = env.get(key)
    if raw in (None, ""):
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {raw!r}") from None


def resolve_durable_settings(persist_to: str | os.PathLike | None = None, every_n_seconds: float | None = None,
                             max_mib_per_second: float | None = None, keep_last: int | None = None,
                             storage_options: Mapping[str, Any] | None = None,
                             environ: Mapping[str, str] | None = None,
                             mtbf_seconds: float | None = None,
                             max_overhead: float | None = None) -> DurableSettings | None:
    """Arguments win, else ``LIGHTNING_FT_PERSIST_*``; None when no ``persist_to`` is set anywhere.

    ``max_mib_per_second <= 0`` means unbounded; ``max_overhead`` 0: the bound is not paced.
    """
    env = os.environ if environ is None else environ
    url = os.fspath(persist_to) if persist_to is not None else env.get(ENV_PERSIST_TO) or None
    if url is None:
        return None
    every = every_n_seconds if every_n_seconds is not None else _env_float(env, ENV_PERSIST_EVERY_SECONDS)
    require_number("persist_every_n_seconds", every, minimum=0, inclusive=True, allow_none=True)
    mtbf = mtbf_seconds if mtbf_seconds is not None else _env_float(env, ENV_MTBF_SECONDS)
    mtbf = DEFAULT_MTBF_SECONDS if mtbf is None else mtbf
    require_number("persist_mtbf_seconds", mtbf, minimum=0)
    rate = max_mib_per_second if max_mib_per_second is not None else _env_float(env, ENV_PERSIST_MAX_MIB_PER_SECOND)
    rate = DEFAULT_MAX_MIB_PER_SECOND if rate is None else rate
    require_number("persist_max_mib_per_second", rate, minimum=float("-inf"))
    keep = keep_last if keep_last is not None else _env_float(env, ENV_PERSIST_KEEP_LAST)
    keep = DEFAULT_PERSIST_KEEP_LAST if keep is None else keep
    if isinstance(keep, float) and keep.is_integer():
        keep = int(keep)
    require_number("persist_keep_last", keep, integer=True, minimum=1, inclusive=True)
    overhead = max_overhead if max_overhead is not None else _env_float(env, ENV_PERSIST_MAX_OVERHEAD)
    overhead = DEFAULT_PERSIST_OVERHEAD if overhead is None else overhead
    require_number("persist_max_overhead", overhead, minimum=0, inclusive=True)
    if overhead >= 1:
        raise ValueError(f"persist_max_overhead is a share of step time below 1 (0.02: 2 %), got {overhead!r}")
    options = dict(storage_options) if storage_options is not None else storage_options_from_env(env)
    return DurableSettings(url, None if every is None else float(every), rate * 2**20 if rate > 0 else None, keep,
                           options, float(mtbf), float(overhead))

"""Settings of the built-in node-health probes (each also a flag of ``lightning-ft health``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_ft.settings import setting
from lightning_ft.settings.fields import boolean, number, parse_flag, parse_text

# Deliberately low: these flag a broken node, not a busy one. A false "unhealthy" costs
# the emergency snapshot, so the defaults must not trip on small containers.
DEFAULT_MIN_FREE_DISK_MB = 100.0
DEFAULT_MIN_AVAILABLE_MEMORY_MB = 100.0


def _paths(raw: str) -> tuple[str, ...]:
    return tuple(p for p in raw.split(os.pathsep) if p)


def _path_list(value: object) -> str | None:
    ok = isinstance(value, (tuple, list)) and all(isinstance(p, (str, os.PathLike)) for p in value)
    return None if ok else f"a list of paths (a {os.pathsep}-separated list in the environment)"


def _optional_command(value: object) -> str | None:
    return None if value is None or isinstance(value, str) else "a command line or None"


@dataclass(frozen=True)
class HealthSettings:
    """What the built-in probes check (:func:`~lightning_ft.health.probes.default_probes`)."""

    host_root: str = setting("/", "where the host's / is visible, for /run/nologin (a container with the host's "
                                  "root mounted elsewhere)", rule=lambda v: None if isinstance(v, str) and v
                             else "a path", env="LIGHTNING_FT_HOST_ROOT", parse=parse_text)
    markers: tuple[str, ...] = setting((), "marker files: one that exists makes the node unhealthy, its content "
                                           "is the reason", rule=_path_list, env="LIGHTNING_FT_HEALTH_MARKERS",
                                       parse=_paths)
    command: str | None = setting(None, "an external check, run without a shell: exit 0 = healthy; killed at "
                                        "the deadline", rule=_optional_command, env="LIGHTNING_FT_HEALTH_COMMAND",
                                  parse=lambda raw: raw or None)
    disk_paths: tuple[str, ...] = setting((), "filesystems checked for free space (default: the temp dir)",
                                          rule=_path_list, env="LIGHTNING_FT_HEALTH_DISK_PATHS", parse=_paths)
    min_free_disk_mb: float = setting(DEFAULT_MIN_FREE_DISK_MB, "minimum free disk in MiB; 0 disables",
                                      rule=number(inclusive=True), env="LIGHTNING_FT_HEALTH_MIN_FREE_DISK_MB")
    min_available_memory_mb: float = setting(DEFAULT_MIN_AVAILABLE_MEMORY_MB, "minimum available memory in MiB; "
                                                                              "0 disables",
                                             rule=number(inclusive=True),
                                             env="LIGHTNING_FT_HEALTH_MIN_AVAILABLE_MEMORY_MB")
    require_cuda: bool = setting(False, "a node without a usable CUDA device is unhealthy", rule=boolean,
                                 env="LIGHTNING_FT_HEALTH_REQUIRE_CUDA", parse=parse_flag)

"""The process environment: the one module of lightning_ft that reads ``os.environ``.

Settings name their own variables (see :mod:`.fields`); this module hands the environment to
the loader and answers the questions about the launcher and scheduler that are not settings:
the run id and failure domain every entry point resolves the same way, the scheduler's node
index, what torchrun tells its workers.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

#: the run id, first of these that is set (TORCHELASTIC_RUN_ID's placeholder ``none`` does not count)
RUN_ID_VARIABLES = ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
ENV_RUN_ID = "LIGHTNING_FT_RUN_ID"
ENV_DOMAIN_ID = "LIGHTNING_FT_DOMAIN_ID"
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
ENV_LOG_LEVEL = "LIGHTNING_FT_LOG_LEVEL"
# what torchrun puts in TORCHELASTIC_RUN_ID when --rdzv-id is not given: not a job's name
_TORCHRUN_PLACEHOLDER_RUN_ID = "none"

#: variables that carry the scheduler's index of this node, first match wins
INFRA_RANK_VARIABLES = (
    "LIGHTNING_FT_INFRA_RANK",  # explicit override
    "SLURM_NODEID",
    "SLURM_PROCID",
    "JOB_COMPLETION_INDEX",  # Kubernetes indexed Job / JobSet
    "GROUP_RANK",
)
# torchrun SIGKILLs its workers this long after forwarding SIGTERM. The agent reads
# `--shutdown-timeout`, else PET_SHUTDOWN_TIMEOUT (its env-backed flag), else
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s. Workers inherit the two environment
# variables but never see the command-line flag.
TORCHELASTIC_SHUTDOWN_VARIABLES = ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")


def environ() -> Mapping[str, str]:
    """The process environment, read at the time of the call."""
    return os.environ


def child_environment(**overrides: str) -> dict[str, str]:
    """A copy of this process's environment with ``overrides``, for a process we start."""
    return {**os.environ, **overrides}


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def run_id_from_environment(env: Mapping[str, str] | None = None) -> str | None:
    """The run id the environment gives (:data:`RUN_ID_VARIABLES`, first set), else None."""
    env = _env(env)
    for key in RUN_ID_VARIABLES:
        value = env.get(key, "").strip()
        if value and not (key == ENV_TORCHELASTIC_RUN_ID and value == _TORCHRUN_PLACEHOLDER_RUN_ID):
            return value
    return None


def fit_run_id(run_id: str, fit: int) -> str:
    """The run id a job's ``fit``-th ``fit()`` (0: the first) keeps its snapshots under: a script's
    fits are stages of one job, and a recovery in one must never restore another's state."""
    return run_id if fit == 0 else f"{run_id}-fit{fit}"


def is_later_fit_of(run_id: str, job_run_id: str) -> bool:
    """Whether ``run_id`` is :func:`fit_run_id` of a later ``fit()`` of the job ``job_run_id``."""
    suffix = run_id[len(job_run_id):] if run_id.startswith(job_run_id) else ""
    return suffix.startswith("-fit") and suffix[4:].isdigit() and suffix[4:].isascii()


def resolve_run_id(explicit: str | None, env: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """The run id and where it came from: ``explicit``, else :func:`run_id_from_environment`.

    Every entry point (the strategy, ``EmergencyCheckpoint``, the exit-code wrapper) resolves
    it here, so they all name the same run. An explicit value that contradicts
    ``LIGHTNING_FT_RUN_ID`` is an error (ValueError naming both); the run id of a later ``fit()``
    of the same job (:func:`fit_run_id`) is that run's, not a contradiction.
    """
    env = _env(env)
    from_env = env.get(ENV_RUN_ID, "").strip() or None
    if explicit is not None:
        if from_env is not None and explicit != from_env and not is_later_fit_of(explicit, from_env):
            raise ValueError(f"contradictory settings: run_id={explicit!r} but {ENV_RUN_ID}={from_env!r}; "
                             "set one of them")
        return explicit, "run_id"
    for key in RUN_ID_VARIABLES:
        value = env.get(key, "").strip()
        if value and not (key == ENV_TORCHELASTIC_RUN_ID and value == _TORCHRUN_PLACEHOLDER_RUN_ID):
            return value, key
    return None, ""


def resolve_domain_id(explicit: str | None, env: Mapping[str, str] | None = None) -> str:
    """This process's failure domain: ``explicit``, else ``LIGHTNING_FT_DOMAIN_ID``, else the host name
    (processes of one host share a domain). The strategy and the torchrun backend both use this."""
    return str(explicit or _env(env).get(ENV_DOMAIN_ID, "").strip() or socket.gethostname())


def scheduler_node_index(env: Mapping[str, str] | None = None) -> int:
    """The scheduler's index of this node (:data:`INFRA_RANK_VARIABLES`), or -1 when none says it.
    Raises ValueError for a malformed value."""
    env = _env(env)
    for name in INFRA_RANK_VARIABLES:
        value = env.get(name)
        if value is None or value == "":
            continue
        try:
            rank = int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not an integer node index") from None
        if rank < 0:
            raise ValueError(f"{name}={value!r} must not be negative")
        return rank
    return -1


def torchelastic_run_id(env: Mapping[str, str] | None = None) -> str | None:
    """``TORCHELASTIC_RUN_ID`` when torchrun started this process, else None."""
    return _env(env).get(ENV_TORCHELASTIC_RUN_ID) or None


def torchelastic_restart_count(env: Mapping[str, str] | None = None) -> int:
    """How often torchrun restarted its worker group (0 outside torchrun)."""
    return int(_env(env).get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def torchelastic_shutdown_timeout(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable, value) of torchrun's worker shutdown timeout as its workers see it, else None."""
    env = _env(env)
    for key in TORCHELASTIC_SHUTDOWN_VARIABLES:
        if env.get(key, "").strip():
            return key, env[key].strip()
    return None


def master_port(env: Mapping[str, str] | None = None) -> int | None:
    """``MASTER_PORT`` (torchrun's worker store), None when unset."""
    return int(_env(env).get("MASTER_PORT", "0") or 0) or None


def local_rank(env: Mapping[str, str] | None = None) -> str:
    return _env(env).get("LOCAL_RANK", "0")


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """``RANK`` as a launcher set it (0 when unset)."""
    return int(_env(env).get("RANK", "0") or 0)


def log_level(env: Mapping[str, str] | None = None) -> str:
    """``LIGHTNING_FT_LOG_LEVEL`` (default INFO), upper case."""
    return _env(env).get(ENV_LOG_LEVEL, "INFO").upper()


def job_label(env: Mapping[str, str] | None = None) -> str:
    """A short name of this job for directory names: the run id the environment gives, else ``job``."""
    return run_id_from_environment(env) or "job"

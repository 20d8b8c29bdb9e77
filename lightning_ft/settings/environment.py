"""The process environment: the one module of lightning_ft that reads ``os.environ``.

Settings name their own variables (see :mod:`.fields`); this module hands the environment to
the loader and answers the questions about the launcher and scheduler that are not settings:
the run id and failure domain every entry point resolves the same way, the scheduler's node
index, what torchrun tells its workers.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)

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


#: every ``LIGHTNING_FT_*`` variable something of this project reads (the package, the SLURM
#: scripts, the test harness); another one is most likely a misspelt one of these
KNOWN_VARIABLES = frozenset({
    "LIGHTNING_FT_AUTOLOAD", "LIGHTNING_FT_DOMAIN_ID", "LIGHTNING_FT_ELASTIC", "LIGHTNING_FT_ENDPOINT",
    "LIGHTNING_FT_EVENTS_DIR",
    "LIGHTNING_FT_EXIT_RECORD_DIR",
    "LIGHTNING_FT_EXIT_RECORD_LAUNCH_DIR", "LIGHTNING_FT_GRACE_SECONDS", "LIGHTNING_FT_HEALTH_COMMAND",
    "LIGHTNING_FT_HEALTH_DISK_PATHS", "LIGHTNING_FT_HEALTH_MARKERS", "LIGHTNING_FT_HEALTH_MIN_AVAILABLE_MEMORY_MB",
    "LIGHTNING_FT_HEALTH_MIN_FREE_DISK_MB", "LIGHTNING_FT_HEALTH_REQUIRE_CUDA", "LIGHTNING_FT_HEALTH_TIMEOUT",
    "LIGHTNING_FT_HOST_ROOT", "LIGHTNING_FT_INFRA_RANK", "LIGHTNING_FT_IS_STORE_HOST", "LIGHTNING_FT_LOG_LEVEL",
    "LIGHTNING_FT_LOCAL_PROCESS", "LIGHTNING_FT_LOCAL_PARENT",
    "LIGHTNING_FT_MTBF_SECONDS", "LIGHTNING_FT_NNODES", "LIGHTNING_FT_PERSIST_EVERY_SECONDS",
    "LIGHTNING_FT_PERSIST_KEEP_LAST", "LIGHTNING_FT_PERSIST_MAX_MIB_PER_SECOND", "LIGHTNING_FT_PERSIST_MAX_OVERHEAD",
    "LIGHTNING_FT_PERSIST_STORAGE_OPTIONS", "LIGHTNING_FT_PERSIST_TO", "LIGHTNING_FT_REJOIN", "LIGHTNING_FT_RUN_ID",
    "LIGHTNING_FT_SECRET",
    "LIGHTNING_FT_SECRET_FILE", "LIGHTNING_FT_SNAPSHOT_DIR", "LIGHTNING_FT_STRAGGLER_FACTOR",
    "LIGHTNING_FT_STRAGGLER_MARKER", "LIGHTNING_FT_PYTHON",
    # the project's own test harness
    "LIGHTNING_FT_TESTS_NO_PREFORK", "LIGHTNING_FT_UPDATE_CHARACTERIZATION", "LIGHTNING_FT_CHARACTERIZATION_DUMP",
    "LIGHTNING_FT_TEST_TIMELINE",
})


def unknown_variables(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each ``LIGHTNING_FT_*`` variable of ``env`` that nothing reads, with the closest known name
    (None when none is close): a misspelt variable must not be silently ignored."""
    found = []
    for name in sorted(_env(env)):
        if name.startswith("LIGHTNING_FT_") and name not in KNOWN_VARIABLES:
            close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.8)
            found.append((name, close[0] if close else None))
    return found


_warned_variables: set[str] = set()


def warn_unknown_variables(env: Mapping[str, str] | None = None) -> None:
    """Log a warning for each unknown ``LIGHTNING_FT_*`` variable (once per name and process)."""
    for name, close in unknown_variables(env):
        if name in _warned_variables:
            continue
        _warned_variables.add(name)
        hint = f"; did you mean {close}?" if close else ""
        log.warning("lightning_ft: the environment variable %s is not one lightning_ft reads (ignored)%s", name, hint)


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


def file_name_of_run(run_id: str) -> str:
    """``run_id`` as a file or directory name: every character but ``A-Za-z0-9._-`` made ``_``
    (the snapshot directories, the run claim and the logger's version record all name it so)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


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


#: set by the first process of a node in the ones it starts for ``Trainer(devices=N)``: which device
#: of the node the process trains on (1..N-1; the first process is 0), and the first process's pid
ENV_LOCAL_PROCESS = "LIGHTNING_FT_LOCAL_PROCESS"
ENV_LOCAL_PARENT = "LIGHTNING_FT_LOCAL_PARENT"


def local_process_index(env: Mapping[str, str] | None = None) -> int:
    """Which of its node's ``devices=N`` processes this is (0: the one the user started)."""
    value = _env(env).get(ENV_LOCAL_PROCESS, "")
    return int(value) if value.isdecimal() and value.isascii() else 0


def tasks_per_node(env: Mapping[str, str] | None = None) -> int:
    """How many tasks per node a scheduler started, the most on any node: ``SLURM_NTASKS_PER_NODE``,
    else srun's ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``4(x2),3``); 1 when unknown."""
    env = _env(env)
    value = env.get("SLURM_NTASKS_PER_NODE", "")
    if value.isdecimal() and value.isascii():
        return int(value)
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = [int(part.split("(")[0]) for part in env.get(name, "").split(",")
                  if part.split("(")[0].isdecimal() and part.isascii()]
        if counts:
            return max(counts)
    return 1


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """``RANK`` as a launcher set it (0 when unset)."""
    return int(_env(env).get("RANK", "0") or 0)


def log_level(env: Mapping[str, str] | None = None) -> str:
    """``LIGHTNING_FT_LOG_LEVEL`` (default INFO), upper case."""
    return _env(env).get(ENV_LOG_LEVEL, "INFO").upper()


def job_label(env: Mapping[str, str] | None = None) -> str:
    """A short name of this job for directory names: the run id the environment gives, else ``job``."""
    return run_id_from_environment(env) or "job"

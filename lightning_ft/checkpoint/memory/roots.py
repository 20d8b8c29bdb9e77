"""Where snapshots live: the root, the run's directory name, this process's rank.

Directory layout::

    <root>/<run_id>/rank<R>/step-<12-digit step>.snap        committed snapshots
    <root>/<run_id>/rank<R>/.tmp-step-<step>-<pid>-<rand>.snap   being written (never loaded)
    <root>/<run_id>/rank<R>/.tmp-spare-<pid>.snap                 preallocated file for the next write

``<root>`` defaults to ``/dev/shm/lightning_ft-<uid>``; without a configured run id ``<run_id>``
is ``default`` and what is written there is never resumed. Every directory on that path must be
a private directory of this user (see ``files.private_dir_problem``).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping

import torch.distributed as dist

from lightning_ft._validation import require
from lightning_ft.checkpoint.memory.files import require_private_dir

ENV_SNAPSHOT_DIR = "LIGHTNING_FT_SNAPSHOT_DIR"
RUN_ID_ENV_VARS = ("LIGHTNING_FT_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
#: directory of snapshots written without a configured run id (never resumed)
DEFAULT_RUN_ID = "default"
# what torchrun puts in TORCHELASTIC_RUN_ID when --rdzv-id is not given: not a job's name
_TORCHRUN_PLACEHOLDER_RUN_ID = "none"


def default_root() -> str:
    """``/dev/shm/lightning_ft-<uid>`` (the temp dir when there is no /dev/shm): one root per user."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) else tempfile.gettempdir()
    return os.path.join(base, f"lightning_ft-{os.getuid()}")


def resolve_root(root: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Explicit ``root``, else ``$LIGHTNING_FT_SNAPSHOT_DIR``, else ``/dev/shm/lightning_ft-<uid>``."""
    env = os.environ if environ is None else environ
    if root is not None:
        return os.fspath(root)
    return env.get(ENV_SNAPSHOT_DIR) or default_root()


def _safe_run_id(run_id: object) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(run_id))
    require(safe not in ("", ".", ".."), "run_id", "usable as a directory name", run_id)
    return safe


def configured_run_id(run_id: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """Explicit ``run_id``, else the first set of LIGHTNING_FT_RUN_ID, TORCHELASTIC_RUN_ID (not
    torchrun's placeholder ``none``), SLURM_JOB_ID; made safe as a directory name. None when no
    run id is configured anywhere: then no snapshot can be shown to belong to this job."""
    if run_id is not None:
        return _safe_run_id(run_id)
    env = os.environ if environ is None else environ
    for key in RUN_ID_ENV_VARS:
        value = env.get(key)
        if value and not (key == "TORCHELASTIC_RUN_ID" and value == _TORCHRUN_PLACEHOLDER_RUN_ID):
            return _safe_run_id(value)
    return None


def resolve_run_id(run_id: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The run's directory name: :func:`configured_run_id`, else ``"default"`` (written, never resumed)."""
    return configured_run_id(run_id, environ) or DEFAULT_RUN_ID


def current_rank(environ: Mapping[str, str] | None = None) -> int:
    """Global rank: the initialized process group's, else $RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    env = os.environ if environ is None else environ
    return int(env.get("RANK", "0") or 0)


def ensure_writable_root(root: str) -> None:
    """Create ``root`` (mode 0700) if needed, check it is a private directory of this user and
    prove it writable; raise ValueError naming ``root``, its owner and mode, and the fix, if not."""
    try:
        if not os.path.lexists(root):
            parent = os.path.dirname(os.path.abspath(root))
            os.makedirs(parent, exist_ok=True)
            try:
                os.mkdir(root, 0o700)
            except FileExistsError:
                pass
        require_private_dir(root, "snapshot root")
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"root={root!r} is not a writable directory: {exc}") from exc

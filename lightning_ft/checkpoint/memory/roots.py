"""Where snapshots live: the root, the run's directory name, this process's rank.

Directory layout::

    <root>/<run_id>/rank<R>/step-<12-digit step>.snap        committed snapshots
    <root>/<run_id>/rank<R>/.tmp-step-<step>-<pid>-<rand>.snap   being written (never loaded)
    <root>/<run_id>/rank<R>/.tmp-spare-<pid>.snap                 preallocated file for the next write

``<root>`` defaults to ``/dev/shm/lightning_ft-<uid>``; without a configured run id ``<run_id>``
is ``default`` and what is written there is never resumed. Every directory on that path must be
a private directory of this user (:mod:`lightning_ft.private_dirs`, :data:`SNAPSHOT_DIRS`).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from lightning_ft._validation import require
from lightning_ft.private_dirs import DirPurpose, make_private_dir
from lightning_ft.settings import load, setting
from lightning_ft.settings.environment import RUN_ID_VARIABLES, file_name_of_run, is_later_fit_of, launcher_rank
from lightning_ft.settings.environment import resolve_run_id as resolve_run_id_from
from lightning_ft.settings.fields import optional_path, parse_text

#: the variables a run id is read from, named in the checkpoint code's messages
RUN_ID_ENV_VARS = RUN_ID_VARIABLES
ENV_SNAPSHOT_DIR = "LIGHTNING_FT_SNAPSHOT_DIR"
#: directory of snapshots written without a configured run id (never resumed)
DEFAULT_RUN_ID = "default"
#: the snapshot root, run and rank directories, in the words of their errors
SNAPSHOT_DIRS = DirPurpose("snapshots", f"another snapshot root (root= or {ENV_SNAPSHOT_DIR})")


def default_root() -> str:
    """``/dev/shm/lightning_ft-<uid>`` (the temp dir when there is no /dev/shm): one root per user."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) else tempfile.gettempdir()
    return os.path.join(base, f"lightning_ft-{os.getuid()}")


@dataclass(frozen=True)
class RootSettings:
    """Where this host's snapshots live."""

    root: str | None = setting(None, "snapshot root (default: /dev/shm/lightning_ft-<uid>, the temp dir when there "
                                     "is no /dev/shm); a private directory of this user", rule=optional_path,
                               env=ENV_SNAPSHOT_DIR, parse=parse_text)


def resolve_root(root: str | os.PathLike | None = None) -> str:
    """``root``, else the ``root`` setting's variable ``LIGHTNING_FT_SNAPSHOT_DIR``, else
    ``/dev/shm/lightning_ft-<uid>``."""
    if root:
        return os.fspath(root)
    return load(RootSettings, {}).root or default_root()


def safe_run_id(run_id: object) -> str:
    """``run_id`` as the name of its snapshot directory (ValueError when it cannot be one)."""
    safe = file_name_of_run(str(run_id))
    require(safe not in ("", ".", ".."), "run_id", "usable as a directory name", run_id)
    return safe


def configured_run_id(run_id: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The run id every entry point resolves (:func:`lightning_ft.settings.environment.resolve_run_id`:
    ``run_id``, else LIGHTNING_FT_RUN_ID, TORCHELASTIC_RUN_ID (not torchrun's placeholder ``none``),
    SLURM_JOB_ID), made safe as a directory name. None when no run id is configured anywhere: then
    no snapshot can be shown to belong to this job."""
    resolved, _ = resolve_run_id_from(run_id, environ)
    return None if resolved is None else safe_run_id(resolved)


def resolve_run_id(run_id: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The run's directory name: :func:`configured_run_id`, else ``"default"`` (written, never resumed)."""
    return configured_run_id(run_id, environ) or DEFAULT_RUN_ID


def current_rank() -> int:
    """Global rank: the initialized process group's, else the launcher's ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return launcher_rank()


def ensure_writable_root(root: str) -> None:
    """Create ``root`` (mode 0700) if needed, check it is a private directory of this user and
    prove it writable; raise ValueError naming ``root``, its owner and mode, and the fix, if not."""
    try:
        make_private_dir(root, "snapshot root", SNAPSHOT_DIRS, parents=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"root={root!r} is not a writable directory: {exc}") from exc


def remove_run_snapshots(root: str, run_id: str) -> list[str]:
    """Remove the snapshot directories of the job ``run_id`` under ``root`` -- its own and each
    later ``fit()``'s (``<run_id>-fit<N>``) -- once the job finished; returns what was removed.
    Only directories of this user, never through a link; a problem is left for the caller to log."""
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        if name != run_id and not is_later_fit_of(name, run_id):
            continue
        path = os.path.join(root, name)
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(path)
            removed.append(path)
    return removed

"""Directories lightning_ft may trust: real directories of this user that nobody else can write.

What a job reads back from a directory it wrote -- snapshots it resumes, the exit records a
node's exit code is made of, durable shards it loads -- is only as trustworthy as the directory.
Another local user who owns it, can write into it, or made its name a symbolic link can plant,
swap or redirect what is read there. So every such directory must be

* a real directory, checked with ``lstat`` (a symbolic link is never followed),
* owned by this user,
* not writable by its group or by other users;

one that is missing is created with mode 0700. Anything else is a ``ValueError`` that names the
directory, what it is for, its owner and mode, and what to do.

Only the directory itself is checked, not its parents: a parent another user can write (one
without the sticky bit ``/tmp`` has) lets that user rename the directory and put another in its
place, which is why a caller that reads back later checks again (``require_private_dir``).

No lightning_ft import: every layer may use it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class DirPurpose:
    """What a trusted directory is for, in the words of its errors."""

    #: what another user could plant there, e.g. ``"snapshots"``
    holds: str
    #: how to pick another one, e.g. ``"another snapshot root (root= or LIGHTNING_FT_SNAPSHOT_DIR)"``
    elsewhere: str


def private_dir_problem(mode: int, uid: int, my_uid: int, purpose: DirPurpose) -> tuple[str, str] | None:
    """(what is wrong, what to do) for a directory with ``lstat`` mode/uid; None if it may be trusted."""
    if stat.S_ISLNK(mode):
        return "is a symbolic link", "use the directory it points to, or remove the link"
    if not stat.S_ISDIR(mode):
        return "is not a directory", f"remove it or choose {purpose.elsewhere}"
    if uid != my_uid:
        return (f"is owned by uid {uid}, not by this user (uid {my_uid})",
                f"remove it (as its owner or root) or choose {purpose.elsewhere}")
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("other users", stat.S_IWOTH)) if mode & bit]
    if writers:
        return f"is writable by {' and '.join(writers)}", "make it private: chmod go-w (or chmod 700) on it"
    return None


def untrusted_dir_message(path: str, what: str, purpose: DirPurpose, st: os.stat_result) -> str | None:
    """The error for the directory ``path`` whose ``lstat`` is ``st``; None if it may be trusted."""
    problem = private_dir_problem(st.st_mode, st.st_uid, os.getuid(), purpose)
    if problem is None:
        return None
    reason, fix = problem
    return (f"{what} {path!r} {reason} (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)} "
            f"{stat.S_IMODE(st.st_mode):04o}); another local user could plant or swap {purpose.holds} there. "
            f"{fix[0].upper()}{fix[1:]}.")


def require_private_dir(path: str, what: str, purpose: DirPurpose) -> os.stat_result:
    """The ``lstat`` of ``path``; ValueError (see the module doc) unless it is a private directory
    of this user, FileNotFoundError if there is nothing there."""
    st = os.lstat(path)
    message = untrusted_dir_message(path, what, purpose, st)
    if message is not None:
        raise ValueError(message)
    return st


def make_private_dir(path: str, what: str, purpose: DirPurpose, parents: bool = False) -> os.stat_result:
    """:func:`require_private_dir`, creating ``path`` with mode 0700 first when it is missing
    (``parents``: its missing parents too, with the default mode)."""
    try:
        return require_private_dir(path, what, purpose)
    except FileNotFoundError:
        pass
    if parents:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:  # created meanwhile: the check below says what it is
        pass
    return require_private_dir(path, what, purpose)

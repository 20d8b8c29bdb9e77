"""This process's own sockets, seen from ``/proc/self/fd``: which are open, and shutting one down
from outside the code that uses it (a call blocked on it then returns at once).

Used to end what nothing else can: a gloo collective blocked on a frozen peer
(:mod:`lightning_ft.runtime.transport`) and store calls stuck on a store that was
replaced by a fail-over (:mod:`lightning_ft.failover.switchboard`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

_FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[int, str]:
    """This process's socket file descriptors -> their kernel identity (``socket:[inode]``)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found  # no procfs: the group cannot be broken from outside (see GroupTransport)
    for name in names:
        try:
            target = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def with_socket(fd: int, action: Callable[[socket.socket], object]) -> bool:
    """``action(sock)`` on a private duplicate of ``fd``; False when ``fd`` is no socket any more."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return bool(action(sock))
    finally:
        sock.close()


def shut_down(sock: socket.socket) -> bool:
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False


def break_connections_to(port: int, hosts: set[str]) -> int:
    """Shut down every connected TCP socket of this process whose peer is ``port`` on one of
    ``hosts`` (addresses); returns how many."""
    count = 0
    for fd in open_sockets():
        def matches(sock: socket.socket) -> bool:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return False
            try:
                peer = sock.getpeername()
            except OSError:
                return False
            return isinstance(peer, tuple) and peer[1] == port and peer[0] in hosts and shut_down(sock)

        if with_socket(fd, matches):
            count += 1
    return count

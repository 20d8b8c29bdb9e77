"""Every private torch name lightning_ft uses, in one place: when torch changes, look here.

Public torch API is used everywhere else; what torch does not offer publicly is wrapped here,
each with the reason it is needed.
"""

from __future__ import annotations

import ctypes
import datetime
import glob
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import _weights_only_unpickler as _weights_only

from lightning_ft._clock import monotonic

#: torch's C++ log levels for ERROR and FATAL (c10: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL)
CPP_LOG_ERROR, CPP_LOG_FATAL = 2, 3

#: c10's log level, once :func:`quiet_cpp_warnings` raised it (else None: the user's choice stands)
_cpp_log_level: ctypes.c_int | None = None
_connects_lock = threading.Lock()
_connects_under_way = 0


def quiet_cpp_warnings() -> bool:
    """Raise torch's C++ log level to ERROR unless the user chose one (``TORCH_CPP_LOG_LEVEL``);
    True when it was raised here.

    Why: this package opens, probes and breaks store connections and process groups on purpose
    (a fail-over, a group broken after a fault), and torch's C++ code logs each of those as a
    warning, often with a C++ stack ("frame #0: ..."); the package says what happened itself, in
    one line. ERROR messages still print. Torch reads ``TORCH_CPP_LOG_LEVEL`` only when libc10
    loads, so the level is set where c10 keeps it: its exported ``FLAGS_caffe2_log_level``. A
    build without that symbol is left as it is."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return False
    libraries = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")))
    try:
        level = ctypes.c_int.in_dll(ctypes.CDLL(libraries[0]), "FLAGS_caffe2_log_level")
    except (IndexError, OSError, ValueError):
        return False
    if level.value >= CPP_LOG_ERROR:
        return False
    level.value = CPP_LOG_ERROR
    global _cpp_log_level
    _cpp_log_level = level
    return True


def connect_quietly(connect: Callable[[], Any]) -> Any:
    """Run ``connect`` (a new TCPStore client) with torch's C++ ERROR logs held back, and return
    what it returns.

    Why: torch's client retries a failed connect or handshake until its timeout and then logs the
    failure at ERROR with the exception's C++ stack ("frame #0: ..."), before raising it. Every
    caller here bounds its connects and says what failed in one line (a store that died as this
    process reached for it is a fault the package handles). Only while at least one such connect
    runs, and only where the package chose the log level (see :func:`quiet_cpp_warnings`)."""
    global _connects_under_way
    level = _cpp_log_level
    if level is None:
        return connect()
    with _connects_lock:
        _connects_under_way += 1
        level.value = CPP_LOG_FATAL
    try:
        return connect()
    finally:
        with _connects_lock:
            _connects_under_way -= 1
            if _connects_under_way == 0:
                level.value = CPP_LOG_ERROR


quiet_cpp_warnings()  # every module that talks to a store or a process group imports this one


def exit_barrier_names() -> tuple[str, str]:
    """torch's elastic exit barrier: its key prefix (the agent's, and ours at the end of fit())
    and the key its last member writes; standby nodes leave when the actives passed it."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN

    return _TERMINAL_STATE_SYNC_ID, _TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN


def exit_barrier_counter() -> str:
    """The key torch's exit barrier counts its arrived members in (see :func:`exit_barrier_names`)."""
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils.store import _NUM_MEMBERS

    return _TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS


def set_default_group_timeout(timeout: datetime.timedelta) -> None:
    """Set the default group's collective timeout after it was created (the group is created
    with a shorter one, which bounds its creation; torch has no public setter)."""
    dist.distributed_c10d._set_pg_timeout(timeout)


def all_groups() -> list[Any]:
    """The default group and every subgroup (a device mesh's) this process holds."""
    return list(dist.distributed_c10d._world.pg_map)


def default_group_store() -> Any:
    """The store the default process group was built over (torch's own ``init_process_group``)."""
    return dist.distributed_c10d._get_default_store()


def tensor_and_storage_classes() -> tuple[type, ...]:
    """Every tensor and storage class torch defines (what its unpickler may rebuild)."""
    import torch

    return (*torch._tensor_classes, *torch._storage_classes)


def tensor_rebuild_functions() -> set[Any]:
    """The functions torch rebuilds tensors with when unpickling (``torch._utils``)."""
    return set(_weights_only._tensor_rebuild_functions())


def weights_only_blocked_modules() -> set[str]:
    """Top-level modules torch's weights_only loader never imports from."""
    return set(_weights_only._blocklisted_modules)


def weights_only_allowed_globals() -> dict[str, Any]:
    """torch's default allow-list of ``torch.load(weights_only=True)``."""
    return dict(_weights_only._get_allowed_globals())


def user_allowed_globals() -> dict[str, Any]:
    """What users allowed with ``torch.serialization.add_safe_globals`` (read at each call)."""
    return dict(_weights_only._get_user_allowed_globals())


#: TCPStore's wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, both backends): a
#: client's first message is VALIDATE (query 0) with this magic number; PING (query 13) is
#: answered with the 4-byte nonce it carried. Measured against torch 2.13's store; not public API.
_TCPSTORE_VALIDATE, _TCPSTORE_PING, _TCPSTORE_MAGIC = 0, 13, 0x3C85F7CE


def _tcpstore_ping(nonce: int) -> bytes:
    """What a TCPStore client sends to validate itself and ping with ``nonce`` (a uint32)."""
    return struct.pack("<BIBI", _TCPSTORE_VALIDATE, _TCPSTORE_MAGIC, _TCPSTORE_PING, nonce)


def _tcpstore_pong(nonce: int) -> bytes:
    """A TCPStore's answer to :func:`_tcpstore_ping` with ``nonce``."""
    return struct.pack("<I", nonce)


#: how long a store is given to answer a ping before the endpoint is reported as not answering
STORE_PING_TIMEOUT = 2.0


def store_ping(host: str, port: int, timeout: float = STORE_PING_TIMEOUT) -> str:
    """Whether a rendezvous store answers at ``host:port``, asked with a plain socket before torch
    connects (whose client, pointed at something else, waits out its whole timeout and logs C++
    backtraces meanwhile): "store", "refused" (nothing listens: its host may not be up yet),
    "silent" (it accepted and said nothing: a frozen store host, or another program), or
    "foreign: <what it did>" (it answered, or closed, as no TCPStore does). One overall deadline."""
    nonce = secrets.randbits(32)
    deadline = monotonic() + timeout
    answer = b""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_tcpstore_ping(nonce))
            while len(answer) < 4:
                remaining = deadline - monotonic()
                if remaining <= 0:
                    return "silent"
                sock.settimeout(remaining)
                chunk = sock.recv(64)
                if not chunk:
                    return f"foreign: it closed the connection{' after ' + repr(answer[:16]) if answer else ''}"
                answer += chunk
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "silent"
    except OSError as exc:
        return f"foreign: {type(exc).__name__}: {exc}"
    return "store" if answer == _tcpstore_pong(nonce) else f"foreign: it answered {answer[:16]!r}"

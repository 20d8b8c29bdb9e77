"""A participant's presence listener: how the others learn, during a store fail-over, whether
this process is alive and which store it follows (see :mod:`lightning_ft.failover.switchboard`).

A refused connection proves the process gone (its host's kernel says so); a frozen or
unreachable one is silent. The listener answers ``<epoch> <store host:port>`` and, on
``FAILOVER <epoch>``, asks its owner to check that store at once.
"""

from __future__ import annotations

import socket
from typing import NamedTuple, Protocol

from lightning_ft.deadlines import BackgroundThread
from lightning_ft.store.tcp import Endpoint, listen_on, parse_endpoint


class PresenceOwner(Protocol):
    """What the listener asks of the process's switchboard."""

    def status_line(self) -> str: ...

    def suspect(self, epoch: int) -> None: ...

    def participating(self) -> bool: ...


class PeerStatus(NamedTuple):
    """What a presence probe found: ``state`` "dead" (refused), "silent" or "alive"; an alive
    peer follows the store of ``epoch`` at ``store`` (host:port)."""

    state: str
    epoch: int = -1
    store: str = ""


def probe(endpoint: str, request: str, timeout: float) -> PeerStatus:
    """Ask the presence listener at ``endpoint`` (``STATUS``, or ``FAILOVER <epoch>``: the store of
    that epoch is lost, check it)."""
    try:
        target = parse_endpoint(endpoint)
        with socket.create_connection((target.host, target.port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(request.encode() + b"\n")
            answer = b""
            while not answer.endswith(b"\n") and len(answer) < 512:
                chunk = sock.recv(512)
                if not chunk:
                    break
                answer += chunk
    except ConnectionRefusedError:
        return PeerStatus("dead")
    except (OSError, ValueError):
        return PeerStatus("silent")
    epoch_text, _, store = answer.decode(errors="replace").strip().partition(" ")
    if not epoch_text.lstrip("-").isdigit():
        return PeerStatus("silent")
    return PeerStatus("alive", int(epoch_text), store)


def local_address_towards(endpoint: Endpoint) -> str:
    """This host's address on the route to ``endpoint``: where peers that reach the store reach us."""
    try:
        family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((endpoint.host, endpoint.port))  # UDP: no packet is sent
            return str(sock.getsockname()[0])
    except OSError:
        return socket.gethostname()


class Presence(BackgroundThread):
    """This participant's presence listener: answers ``<epoch> <store host:port>`` (the store it
    follows, or serves during its own fail-over), and starts a check on ``FAILOVER <epoch>``."""

    def __init__(self, switchboard: PresenceOwner, host: str, join_timeout: float) -> None:
        super().__init__("lightning_ft-presence", join_timeout)
        self.switchboard = switchboard
        self.host = host
        self._sock = listen_on(host, 0)
        # the owner stops it when its participant leaves (shutting the socket down wakes the
        # accept); the timeout only backs that up. Not shorter: thousands of listeners in a
        # process, each woken every second to ask, cost more CPU than the rendezvous itself
        self._sock.settimeout(10.0)
        self.endpoint = f"{host}:{self._sock.getsockname()[1]}"

    def run(self) -> None:
        while not self.stopping.is_set():
            if not self.switchboard.participating():
                self._sock.close()  # left the rendezvous: refused from now on, i.e. gone for the others
                return
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(1.0)
                    request = conn.recv(128).decode(errors="replace").strip()
                    conn.sendall(self.switchboard.status_line().encode() + b"\n")
                except OSError:
                    continue
            kind, _, epoch = request.partition(" ")
            if kind == "FAILOVER" and epoch.isdigit():
                self.switchboard.suspect(int(epoch))

    def stop(self, join: bool = True) -> None:
        """Close the listener: from now on connecting is refused (this participant is gone)."""
        self.stopping.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass  # not listening (any more)
        super().stop(join)
        self._sock.close()



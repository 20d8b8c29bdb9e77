"""What a participant finds at the rendezvous endpoint before torch connects to it (issue 36,
item 7): a store, nothing, a silent listener, or another program -- with real sockets and a
real TCPStore."""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from lightning_ft.settings import Timeouts
from lightning_ft.store.tcp import Endpoint, connect_store, host_store, store_ping


@contextlib.contextmanager
def listener(answer: bytes | None):
    """A listening socket on a free loopback port: each connection gets ``answer`` and is closed
    (None: accepted and left silent until the end)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.1)
    stop, held = threading.Event(), []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            if answer is None:
                held.append(conn)
                continue
            with conn:
                with contextlib.suppress(OSError):
                    conn.recv(64)
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


def free_closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_the_ping_tells_a_store_from_nothing_a_silent_listener_and_another_program():
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=10))
    assert store_ping("127.0.0.1", store.port) == "store"
    assert store_ping("127.0.0.1", free_closed_port()) == "refused"
    with listener(None) as port:
        assert store_ping("127.0.0.1", port, timeout=0.3) == "silent"
    with listener(b"HTTP/1.0 400 Bad Request\r\n\r\n") as port:
        assert store_ping("127.0.0.1", port, timeout=2.0) == "foreign: it answered b'HTTP/1.0 400 Bad'"
    with listener(b"") as port:
        assert store_ping("127.0.0.1", port, timeout=2.0) == "foreign: it closed the connection"


@pytest.mark.timeout(60)
def test_an_endpoint_held_by_another_program_fails_at_once_and_a_silent_one_is_said_at_once(caplog):
    timeouts = Timeouts(connect_timeout=2.0)
    with listener(b"SSH-2.0-OpenSSH_9.6\r\n") as port:
        with pytest.raises(RendezvousConnectionError, match=rf"127.0.0.1:{port} is held by a program that is not a "
                                                             rf"rendezvous store \(it answered b'SSH-2.0-Open"):
            connect_store(Endpoint("127.0.0.1", port), None, timeouts)
    with caplog.at_level(logging.WARNING, logger="lightning_ft.store.tcp"), listener(None) as port:
        with pytest.raises(RendezvousConnectionError, match=f"is port {port} its"):
            connect_store(Endpoint("127.0.0.1", port), False, timeouts)
    assert any("accepts connections but does not answer as a store" in r.getMessage() for r in caplog.records)
    # a real store's host is connected to as before
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=10))
    client, hosts = connect_store(Endpoint("127.0.0.1", store.port), False, timeouts)
    assert not hosts
    client.set("k", b"v")
    assert store.get("k") == b"v"

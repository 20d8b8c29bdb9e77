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

#: a program that answers every read with its last 4 bytes: the ping's nonce comes back as a
#: store's answer would, and nothing else it says is a store's
ECHO_LAST_4 = object()


@contextlib.contextmanager
def listener(answer: bytes | None | object):
    """A listening socket on a free loopback port: each connection gets ``answer`` and is closed
    (None: accepted and left silent until the end; ``ECHO_LAST_4``: kept open, each read answered
    with its last 4 bytes)."""
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
            if answer is ECHO_LAST_4:
                held.append(conn)
                threading.Thread(target=echo_last_4, args=(conn,), daemon=True).start()
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


def echo_last_4(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := conn.recv(4096):
            conn.sendall(data[-4:])


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
        with pytest.raises(RendezvousConnectionError, match=f"answered nothing as a store .*holds port {port}"):
            connect_store(Endpoint("127.0.0.1", port), False, timeouts)
    assert any("accepts connections but does not answer as a store" in r.getMessage() for r in caplog.records)
    # a real store's host is connected to as before
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=10))
    client, hosts = connect_store(Endpoint("127.0.0.1", store.port), False, timeouts)
    assert not hosts
    client.set("k", b"v")
    assert store.get("k") == b"v"


@pytest.mark.timeout(60)
def test_a_silent_endpoint_and_one_that_only_echoes_the_ping_end_in_seconds_saying_which(monkeypatch):
    """A port held by a program that accepts and says nothing was waited on for connect_timeout (60
    s) and then for a store call still under way (82 s more); one that echoes the ping's nonce
    passed for a store, and the first store request waited out store_timeout (30 s) before a
    traceback. Now: silent for the ping's 2 s plus SILENT_ENDPOINT_PATIENCE, or no answer to a
    store request within FIRST_ANSWER_TIMEOUT, and a clear error naming the port."""
    import time

    from lightning_ft.store import tcp

    monkeypatch.setattr(tcp, "SILENT_ENDPOINT_PATIENCE", 1.0)
    timeouts = Timeouts()  # connect_timeout 60 s, store_timeout 30 s
    with listener(None) as port:
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match=f"has answered nothing as a store for 3s .*port {port}"):
            connect_store(Endpoint("127.0.0.1", port), None, timeouts)
        assert time.monotonic() - started < 10
    with listener(ECHO_LAST_4) as port:
        assert store_ping("127.0.0.1", port) == "store"  # the nonce came back
        started = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match=f"{port} answered the ping but not a store request"):
            connect_store(Endpoint("127.0.0.1", port), None, timeouts)
        assert time.monotonic() - started < tcp.FIRST_ANSWER_TIMEOUT + 5

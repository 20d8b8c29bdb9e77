"""The presence channel of a store fail-over must not become the fault (issue 37): the listener
survives any input and answers a probe within its bound whatever other clients do, a probe
takes only an authentic answer as "alive", and returns by its deadline whatever the listener
does. Real sockets throughout, on loopback."""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import selectors
import socket
import threading
import time

import pytest

from lightning_ft.failover.listener import PER_PEER, Presence
from lightning_ft.failover.presence import PeerStatus, PresenceProof, probe
from lightning_ft.schema.signing import Signer
from lightning_ft.settings import Timeouts

PROBE_TIMEOUT = 0.5
#: the bound of probes that test what is judged, not how fast (a loaded test machine is slow)
PATIENT = 5.0
STORE = "10.0.0.7:29500"
EPOCH = 4


class Owner:
    """What a switchboard is to its listener: who it is, the store it follows, the checks asked of it."""

    def __init__(self, secret: bytes | None, participant_id: str = "node-a:4242:0", run_id: str = "run-37",
                 incarnation: int = 2, launch_id: str = "5f" * 16) -> None:
        self.participant_id = participant_id
        self.proof = PresenceProof(Signer(secret), run_id, incarnation, launch_id)
        self.suspects: list[int] = []
        self.suspected = threading.Event()
        self.fail_participating = 0  # how many calls of participating() raise

    def presence_status(self) -> tuple[int, str]:
        return EPOCH, STORE

    def suspect(self, epoch: int) -> None:
        self.suspects.append(epoch)
        self.suspected.set()

    def participating(self) -> bool:
        if self.fail_participating > 0:
            self.fail_participating -= 1
            raise RuntimeError("a fault of the owner, injected by the test")
        return True


@pytest.fixture
def make_listener():
    started: list[Presence] = []

    def make(secret: bytes | None, **identity) -> tuple[Owner, Presence]:
        owner = Owner(secret, **identity)
        presence = Presence(owner, "127.0.0.1", Timeouts(probe_timeout=PROBE_TIMEOUT))
        presence.start()
        started.append(presence)
        return owner, presence

    yield make
    for presence in started:
        presence.stop()


def ask(owner: Owner, presence: Presence, request: str = "STATUS", timeout: float = PATIENT) -> PeerStatus:
    return probe(presence.endpoint, request, timeout, owner.participant_id, owner.proof)


def raw_answer(port: int) -> tuple[bytes, str]:
    """A STATUS request's answer line, as anyone who asks gets it, and the nonce it was asked with."""
    n = nonce()
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENT) as sock:
        sock.sendall(b"STATUS " + n + b"\n")
        return sock.makefile("rb").readline(), n.decode()


def connect(presence: Presence) -> socket.socket:
    return socket.create_connection(("127.0.0.1", presence.port), timeout=5.0)


def send_raw(presence: Presence, data: bytes) -> bytes:
    """Send ``data`` on a connection of its own and read until the listener closes it: what it answered."""
    received = b""
    with connect(presence) as sock:
        try:
            sock.sendall(data)
            while chunk := sock.recv(4096):
                received += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass  # dropped with our bytes unread: no answer either
    return received


def nonce() -> bytes:
    return secrets.token_hex(16).encode()


EXPECTED = PeerStatus("alive", EPOCH, STORE)


# ------------------------------------------------------------------ input that once ended the listener


@pytest.mark.timeout(30)
@pytest.mark.parametrize("secret", [None, b"job-secret"], ids=["no-secret", "job-secret"])
def test_a_failover_line_with_a_superscript_digit_leaves_the_listener_answering(make_listener, secret):
    owner, presence = make_listener(secret)
    line = "FAILOVER ²\n".encode()
    assert len(line) == 12  # the line of issue 37: str.isdigit() took '²', int() raised in the thread
    assert send_raw(presence, line) == b""  # dropped, unanswered
    assert ask(owner, presence, "FAILOVER 3") == EXPECTED
    assert owner.suspected.wait(5.0)
    assert owner.suspects == [3]  # the authentic request asked for a check; the bogus one did not
    assert presence.alive and presence.failures == 0


def malformed_requests() -> list[bytes]:
    n = nonce()
    return [
        "FAILOVER ٣ ".encode() + n + b"\n",  # Arabic-Indic digit
        "FAILOVER １２ ".encode() + n + b"\n",  # fullwidth digits
        "FAILOVER ² ".encode() + n + b"\n",
        b"FAILOVER \x00 " + n + b"\n",
        b"STATUS \x00" + n + b"\n",
        b"\x00" * 64 + b"\n",
        b"FAILOVER -1 " + n + b"\n",
        b"FAILOVER " + b"9" * 40 + b" " + n + b"\n",
        b"FAILOVER 1\n",  # the old protocol: no nonce
        b"STATUS\n",
        b"STATUS " + n.upper() + b"\n",
        b"STATUS " + n + b" more\n",
        b"STATUS  " + n + b"\n",
        b"STATUS\t" + n + b"\n",
        b"STATUS " + n + b"\r\n",
        b"STATUS " + b"a" * 100_000 + b"\n",  # a very long line
        b"A" * 200_000,  # longer still, no newline
        b"\n",
        b"\xff\xfe\xfd\n",
    ]


class Crowd:
    """Clients that hold the listener: ``idle`` connections that send nothing, ``trickling`` ones
    that send a request one byte per 0.1 s, and a fuzzer that sends random bytes; each one the
    listener drops is replaced (the new one opened before the old one is closed, so as many are
    always held). Counts what the listener did to them."""

    def __init__(self, presence: Presence, idle: int, trickling: int, seed: int) -> None:
        self.presence, self.rng = presence, random.Random(seed)
        self.stop = threading.Event()
        self.idle_dropped = self.idle_answered = self.trickle_dropped = self.trickle_served = 0
        self.fuzz_sent = self.fuzz_answered = self.fuzz_hung = 0
        self.trickling_now = 0
        self._lock = threading.Lock()
        self.idle = [connect(presence) for _ in range(idle)]
        self.threads = [threading.Thread(target=self._hold_idle, daemon=True),
                        threading.Thread(target=self._fuzz, daemon=True)]
        self.threads += [threading.Thread(target=self._trickle, daemon=True) for _ in range(trickling)]
        for thread in self.threads:
            thread.start()

    def held(self) -> int:
        """Connections held open by this side right now."""
        with self._lock:
            return len(self.idle) + self.trickling_now

    def _hold_idle(self) -> None:
        with selectors.DefaultSelector() as selector:
            for sock in self.idle:
                selector.register(sock, selectors.EVENT_READ)
            while not self.stop.is_set():
                for key, _ in selector.select(0.05):
                    old = key.fileobj
                    try:
                        answered = old.recv(64) != b""  # an idle client is sent nothing, only the close
                    except ConnectionResetError:
                        answered = False
                    new = connect(self.presence)
                    with self._lock:
                        self.idle[self.idle.index(old)] = new
                        self.idle_dropped += 1
                        self.idle_answered += answered
                    selector.unregister(old)
                    old.close()
                    selector.register(new, selectors.EVENT_READ)

    def _trickle(self) -> None:
        sock = connect(self.presence)
        with self._lock:
            self.trickling_now += 1
        try:
            while not self.stop.is_set():
                try:
                    for byte in b"STATUS " + nonce() + b"\n":
                        if self.stop.wait(0.1):
                            return
                        sock.sendall(bytes([byte]))
                    self.trickle_served += 1  # a request trickled over 3 s got through: a failure
                except (BrokenPipeError, ConnectionResetError):
                    with self._lock:
                        self.trickle_dropped += 1
                sock, old = connect(self.presence), sock
                old.close()
        finally:
            sock.close()
            with self._lock:
                self.trickling_now -= 1

    def _fuzz(self) -> None:
        while not self.stop.is_set():
            blob = self.rng.randbytes(self.rng.randrange(1, 2048))
            with connect(self.presence) as sock:
                answered = hung = False
                try:
                    sock.sendall(blob)
                    sock.settimeout(2.0)
                    answered = sock.recv(64) != b""
                except (BrokenPipeError, ConnectionResetError):
                    pass  # dropped with bytes unread
                except TimeoutError:
                    hung = True  # neither answered nor dropped
            with self._lock:
                self.fuzz_sent += 1
                self.fuzz_answered += answered
                self.fuzz_hung += hung

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10.0)
        for sock in self.idle:
            sock.close()


@pytest.mark.timeout(120)
def test_no_input_and_no_crowd_of_idle_or_trickling_clients_keeps_a_probe_from_its_answer(make_listener):
    owner, presence = make_listener(b"job-secret")
    for request in malformed_requests():
        assert send_raw(presence, request) == b"", request[:40]
    assert presence.alive and owner.suspects == []

    crowd = Crowd(presence, idle=50, trickling=5, seed=37)
    try:
        deadline = time.monotonic() + 60.0
        while crowd.held() < 55 and time.monotonic() < deadline:
            time.sleep(0.01)
        statuses, held = [], []
        while (len(statuses) < 10 or crowd.idle_dropped < 50 or crowd.trickle_dropped < 5) and \
                time.monotonic() < deadline:
            held.append(crowd.held())
            statuses.append(ask(owner, presence, f"FAILOVER {len(statuses)}", PROBE_TIMEOUT))
            time.sleep(0.05)
    finally:
        crowd.close()
    # every probe was made while the whole crowd was held, and each got its authentic answer in
    # time; meanwhile the listener dropped idle and trickling clients at their deadline, again and again
    assert held and min(held) >= 55, held
    assert statuses == [EXPECTED] * len(statuses)
    assert crowd.idle_dropped >= 50 and crowd.idle_answered == 0
    assert crowd.trickle_dropped >= 5 and crowd.trickle_served == 0
    assert crowd.fuzz_sent > 0 and crowd.fuzz_answered == 0 and crowd.fuzz_hung == 0
    assert presence.alive and presence.failures == 0
    owner.suspected.wait(5.0)
    assert set(owner.suspects) <= set(range(len(statuses)))  # garbage never asked for a check


@pytest.mark.timeout(60)
def test_connections_beyond_the_bound_per_peer_drop_the_oldest_and_a_probe_still_gets_its_answer(make_listener):
    owner, presence = make_listener(None)
    presence.request_deadline = 30.0  # only the bound drops a connection here, not the deadline
    held = [connect(presence) for _ in range(PER_PEER + 5)]
    try:
        for sock in held[:5]:  # the oldest five: dropped to make room
            sock.settimeout(10.0)
            assert sock.recv(64) == b""
        assert ask(owner, presence) == EXPECTED  # it takes a place too (the next oldest goes)
        with selectors.DefaultSelector() as selector:
            for sock in held[6:]:
                selector.register(sock, selectors.EVENT_READ)
            assert selector.select(0.2) == []  # the newer ones are still held by the listener
    finally:
        for sock in held:
            sock.close()


# ------------------------------------------------------------------ squatters


class Squatter:
    """A plain socket server on ``port`` that answers every request with ``answer``."""

    def __init__(self, port: int, answer: bytes) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(8)
        self.answer, self.answered = answer, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):
                    conn.recv(256)
                    conn.sendall(self.answer)
                    self.answered.set()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10.0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("secret", [None, b"job-secret"], ids=["no-secret", "job-secret"])
def test_a_squatter_on_a_dead_participants_port_that_replays_its_answer_is_not_alive(make_listener, secret):
    owner, presence = make_listener(secret)
    copied, n = raw_answer(presence.port)  # what anyone who asked once got
    assert owner.proof.check(copied.rstrip(b"\n"), owner.participant_id, n) == EXPECTED
    presence.stop()  # the participant dies; another process takes its port and answers as it did
    assert ask(owner, presence).state == "dead"
    squatter = Squatter(presence.port, copied)
    try:
        assert ask(owner, presence).state == "dead"  # a whole answer that is not the participant's: gone
        assert squatter.answered.wait(PATIENT)  # it did answer: the answer was judged, and refused
    finally:
        squatter.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("other", [dict(secret=b"another-jobs-secret"), dict(participant_id="node-a:5151:0"),
                                   dict(run_id="another-run"), dict(incarnation=3), dict(launch_id="a0" * 16),
                                   dict(secret=None)],
                         ids=["other-secret", "other-participant", "other-run", "other-incarnation",
                              "earlier-launch-same-secret", "no-secret"])
def test_a_listener_of_another_participant_launch_or_secret_is_not_alive(make_listener, other):
    expected = Owner(b"job-secret")
    identity = {k: v for k, v in other.items() if k != "secret"}
    _, listener = make_listener(other.get("secret", b"job-secret"), **identity)
    line, n = raw_answer(listener.port)
    assert line.endswith(b"\n")  # it answers, as it answers anyone: the answer is judged, and refused
    assert expected.proof.check(line.rstrip(b"\n"), expected.participant_id, n).state == "dead"
    assert ask(expected, listener).state == "dead"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("secret", [None, b"job-secret"], ids=["no-secret", "job-secret"])
def test_the_plain_protocol_tells_participants_and_runs_apart_and_a_secret_also_stops_a_forger(make_listener, secret):
    owner, presence = make_listener(secret)
    assert ask(owner, presence) == EXPECTED
    line, n = raw_answer(presence.port)
    for other in (Owner(secret, participant_id="node-b:1:0"), Owner(secret, run_id="other-run"),
                  Owner(secret, launch_id="a0" * 16)):
        assert other.proof.check(line.rstrip(b"\n"), other.participant_id, n).state == "dead"
        assert ask(other, presence).state == "dead"

    # a forger that speaks the protocol: it echoes each nonce and names the expected participant
    # and run (both readable from the store), but has no secret
    forger = socket.socket()
    forger.bind(("127.0.0.1", 0))
    forger.listen(8)
    plain = PresenceProof(Signer(None), owner.proof.run_id, owner.proof.incarnation, owner.proof.launch_id)
    answered = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = forger.accept()
            with conn:
                request = conn.makefile("rb").readline().split()
                conn.sendall(plain.answer(owner.participant_id, EPOCH, STORE, request[-1].decode()))
                answered.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        status = probe(f"127.0.0.1:{forger.getsockname()[1]}", "STATUS", PATIENT, owner.participant_id, owner.proof)
        thread.join(10.0)
    finally:
        forger.close()
    # with a secret it needs the MAC; without one it passes: the residual risk presence.py names
    assert answered.is_set()
    assert status == (EXPECTED if secret is None else PeerStatus("dead"))


# ------------------------------------------------------------------ the probe's own deadline


@pytest.mark.timeout(60)
def test_a_listener_that_trickles_its_answer_leaves_the_probe_silent_at_its_deadline():
    owner = Owner(b"job-secret")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    events: list[str] = []
    sent = [0]
    answer_length = [0]

    def trickle() -> None:
        conn, _ = server.accept()
        with conn:
            request = conn.makefile("rb").readline().split()
            # an authentic answer, for the probe's own nonce: only its pace is wrong
            answer = owner.proof.answer(owner.participant_id, EPOCH, STORE, request[-1].decode())
            answer_length[0] = len(answer)
            try:
                for byte in answer:
                    conn.sendall(bytes([byte]))
                    sent[0] += 1
                    time.sleep(0.05)
                events.append("answer sent whole")
            except (BrokenPipeError, ConnectionResetError):
                events.append("the probe hung up")

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        status = probe(f"127.0.0.1:{server.getsockname()[1]}", "STATUS", PROBE_TIMEOUT, owner.participant_id,
                       owner.proof)
        sent_when_it_returned = sent[0]
        thread.join(30.0)
    finally:
        server.close()
    # it gave up at its deadline, with the answer partly sent; the server then found it gone
    assert status.state == "silent"
    assert 0 < sent_when_it_returned < answer_length[0]
    assert events == ["the probe hung up"]


# ------------------------------------------------------------------ the loop itself


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def listener_log():
    logger = logging.getLogger("lightning_ft.failover.listener")
    handler = Records()
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


@pytest.mark.timeout(30)
def test_a_failure_of_the_loop_is_logged_at_error_and_the_loop_restarted(make_listener, listener_log):
    owner, presence = make_listener(b"job-secret")
    owner.fail_participating = 1
    send_raw(presence, b"\n")  # wakes the loop, which then fails once
    deadline = time.monotonic() + 10.0
    while presence.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ask(owner, presence) == EXPECTED
    errors = [r.getMessage() for r in listener_log if r.levelno == logging.ERROR]
    assert presence.failures == 1 and any("restarting" in m for m in errors), errors


@pytest.mark.timeout(30)
def test_a_broken_listening_socket_listens_again_on_the_same_port(make_listener, listener_log):
    owner, presence = make_listener(None)
    endpoint = presence.endpoint
    presence._sock.shutdown(socket.SHUT_RDWR)  # breaks under the loop, which was not stopped
    deadline = time.monotonic() + 10.0
    while not any("listens again" in r.getMessage() for r in listener_log) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert presence.endpoint == endpoint and presence.alive
    assert ask(owner, presence) == EXPECTED
    assert [r.levelno for r in listener_log if "listens again" in r.getMessage()] == [logging.ERROR]


def test_only_a_refused_presence_port_proves_its_participant_gone(make_listener):
    """What the coordinator of a round takes as proof that a silent previous active ended: its
    presence port refuses. A listener that answers, and one whose process is frozen (the
    kernel accepts, nobody answers), prove nothing; a stopped listener's port refuses."""
    from lightning_ft.failover.presence import refuses

    _, presence = make_listener(None)
    assert not refuses(presence.endpoint, PATIENT)
    with socket.create_server(("127.0.0.1", 0), backlog=4) as frozen:  # listens, never accepts
        assert not refuses(f"127.0.0.1:{frozen.getsockname()[1]}", PATIENT)
    presence.stop()
    assert refuses(presence.endpoint, PATIENT)
    assert not refuses("not an endpoint", PATIENT)

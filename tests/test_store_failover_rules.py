"""The pure rules of a store fail-over (quorum, rebuilding the state) and its small real parts
(the presence listener, the mirror of store calls) -- no training processes."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from lightning_ft.deadlines import BoundedStore
from lightning_ft.failover.connection import FailoverStore
from lightning_ft.failover.rebuild import Mirror, may_serve, merge_views
from lightning_ft.failover.switchboard import StoreSwitchboard, probe
from lightning_ft.schema.failover import ViewEntry, decode_view, encode_view
from lightning_ft.schema.signing import SealedStore, Signer
from lightning_ft.settings import Timeouts
from lightning_ft.store.tcp import Endpoint, host_store, parse_endpoint

# ------------------------------------------------------------------ the quorum


def test_a_majority_of_those_not_proven_gone_may_serve():
    participants = ["a", "b", "c"]
    assert may_serve(participants, {"b": True, "c": False}, dead=set()).serve
    assert not may_serve(participants, {"b": True}, dead=set()).serve  # 1 of 3: a partition's minority
    assert may_serve(participants, {"b": True}, dead={"a"}).serve is False  # 1 of 2 is no majority
    assert may_serve(participants, {"b": True}, dead={"a", "c"}).serve  # the others are gone: 1 of 1


def test_two_survivors_of_two_may_serve_when_the_store_host_is_gone():
    assert may_serve(["host", "b"], {"b": True}, dead={"host"}).serve


def test_spares_alone_do_not_serve_while_an_active_may_be_alive():
    verdict = may_serve(["a", "b", "s"], {"s": False}, dead={"a", "b"})
    assert not verdict.serve and "active" in verdict.reason  # who was active is not known here
    # b was active and is not proven gone (frozen, or on the other side of a partition): it may
    # still train with a store of its own
    verdict = may_serve(["a", "b", "s", "t"], {"s": False, "t": False}, dead={"a"}, actives={"a", "b"})
    assert not verdict.serve and "active" in verdict.reason


def test_spares_serve_when_every_active_is_proven_gone():
    """Both actives died at once, with the store: no partition can hold them, and the spares go on
    from the replica they hold (issue 45, two nodes lost at once)."""
    assert may_serve(["a", "b", "s", "t"], {"s": False, "t": False}, dead={"a", "b"}, actives={"a", "b"}).serve
    # still a majority of those not proven gone
    assert not may_serve(["a", "b", "s", "t", "u"], {"s": False}, dead={"a", "b"}, actives={"a", "b"}).serve


def test_registrations_of_strangers_do_not_count():
    assert not may_serve(["a", "b", "c"], {"a": True, "x": True, "y": True}, dead=set()).serve


# ------------------------------------------------------------------ rebuilding


def sealed_number(signer: Signer, key: str, n: int) -> bytes:
    return signer.seal(key, str(n))


def test_numbers_take_the_highest_seen_and_logs_the_union():
    signer = Signer(b"secret")
    mine = {"round": ViewEntry("value", sealed_number(signer, "round", 3)),
            "log": ViewEntry("log", b"\nA\n\nB\n", (b"C",)),
            "other": ViewEntry("value", b"x")}
    theirs = {"round": ViewEntry("value", sealed_number(signer, "round", 4)),
              "log": ViewEntry("value", b"\nA\n\nD\n"),
              "other": ViewEntry("value", b"y"),
              "count": ViewEntry("counter", b"7")}
    merged = merge_views([mine, theirs])
    assert signer.unseal("round", merged["round"]) == b"4"
    assert sorted(merged["log"].split()) == [b"A", b"B", b"C", b"D"]
    assert merged["other"] == b"x"  # the successor's own view first
    assert merged["count"] == b"7"


def test_a_view_survives_encoding_and_garbage_is_refused():
    view = {"k": ViewEntry("log", b"\nA\n", (b"B",)), "n": ViewEntry("counter", b"3")}
    assert decode_view(encode_view(view)) == view
    for garbage in (b"", b"[]", b'{"k": ["bogus", "", []]}', b"\xff"):
        assert decode_view(garbage) is None


def test_the_mirror_keeps_what_calls_tell():
    mirror = Mirror()
    mirror.record("set", ("a", "1"), None)
    mirror.record("compare_set", ("b", "", "2"), b"3")  # the value in force is what it returned
    mirror.record("append", ("log", b"\nR1\n"), None)
    mirror.record("get", ("log", ), b"\nR0\n\nR1\n")
    mirror.record("append", ("log", b"\nR2\n"), None)
    mirror.record("multi_get", (["c", "d"],), [b"4", b"5"])
    mirror.record("set", ("lightning_ft_failover/epoch", "1"), None)  # never copied on
    mirror.record("set", ("big", b"x" * (1 << 20)), None)
    mirror.record("set", ("gone", "1"), None)
    mirror.record("delete_key", ("gone",), None)
    view = mirror.view()
    assert view["a"].value == b"1" and view["b"].value == b"3"
    assert view["c"].value == b"4" and view["d"].value == b"5"
    assert view["log"].kind == "log"
    assert sorted(merge_views([view])["log"].split()) == [b"R0", b"R1", b"R2"]
    assert "lightning_ft_failover/epoch" not in view and "big" not in view and "gone" not in view


# ------------------------------------------------------------------ real sockets


def free_refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed on exit: nothing listens there


@pytest.fixture
def switchboard():
    timeouts = Timeouts(failover_timeout=3.0, probe_timeout=0.5)
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=5))
    first = BoundedStore(store, 5.0)
    board = StoreSwitchboard(Endpoint("127.0.0.1", store.port), first, True, "me", timeouts, Signer(None))
    board.presence.start()
    try:
        yield board, store
    finally:
        board.close()


def test_presence_says_alive_and_which_store_and_a_closed_port_is_dead(switchboard):
    board, store = switchboard
    status = probe(board.presence.endpoint, "STATUS", 1.0, "me", board.proof)
    assert status.state == "alive" and status.epoch == 0 and status.store == f"127.0.0.1:{store.port}"
    assert probe(f"127.0.0.1:{free_refused_port()}", "STATUS", 1.0, "me", board.proof).state == "dead"
    board.close()
    assert probe(board.presence.endpoint, "STATUS", 1.0, "me", board.proof).state == "dead"


def test_a_failover_store_mirrors_its_calls_and_hands_torch_the_current_client(switchboard):
    board, store = switchboard
    client = FailoverStore(board, 5.0)
    values = SealedStore(client, board.signer)
    values.put("run/round", "2")
    values.append("run/lost", "x")
    assert values.get("run/round") == b"2"
    assert isinstance(client.raw, dist.TCPStore)
    view = board.mirror.view()
    assert view["run/round"].value == b"2" and view["run/lost"].kind == "log"
    clone = client.clone(2.0)
    assert clone.bound == 2.0 and clone.get("run/round") == b"2"


@pytest.mark.timeout(60)
def test_a_connect_to_a_gone_or_replaced_store_returns_at_once(switchboard):
    """torch's client retries a refused connect until its timeout, and a connect to a silent host
    waits that long: a connection of a fail-over participant must not (it holds its lock, and
    every call of that connection waits behind it -- seen as an 11 s recovery)."""
    import threading
    import time

    from lightning_ft.failover.switchboard import StoreUnreachableError

    board, _ = switchboard
    start = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="refused"):
        board._client(Endpoint("127.0.0.1", free_refused_port()), 30.0, within=30.0)
    assert time.monotonic() - start < 10.0  # one refused TCP connect; the connect's own bound is 30 s

    silent = socket.socket()  # listens, never answers: a frozen host
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    try:
        board.endpoint = Endpoint("127.0.0.1", port)
        replaced = threading.Timer(0.5, setattr, (board, "epoch", 1))  # a fail-over moves on
        replaced.start()
        start = time.monotonic()
        with pytest.raises(StoreUnreachableError, match="abandoned"):
            board.connect(30.0)
        assert time.monotonic() - start < 20.0
        replaced.join()
    finally:
        silent.close()
    # the abandoned connect goes on (torch's call cannot be cancelled): a store on that port lets
    # it end now, rather than the interpreter's exit waiting for its bound
    _KEEP.append(host_store("127.0.0.1", port, datetime.timedelta(seconds=5)))


_KEEP: list = []


def test_the_host_of_the_store_never_fails_over_its_own_store(switchboard):
    board, _ = switchboard
    board.fail_over(0, "a test says so")
    assert board.epoch == 0 and board.failovers == []


@pytest.mark.timeout(60)
def test_without_candidates_a_lost_store_is_lost():
    # a fail-over deadline far beyond the test's timeout: a host that refuses connections is lost
    # at once, not waited for (as a silent one is, see below)
    timeouts = Timeouts(failover_timeout=600.0, probe_timeout=0.2)
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=5))
    port = store.port
    first = BoundedStore(dist.TCPStore("127.0.0.1", port, is_master=False,
                                       timeout=datetime.timedelta(seconds=5)), 2.0)
    board = StoreSwitchboard(Endpoint("127.0.0.1", port), first, False, "me", timeouts, Signer(None))
    client = FailoverStore(board, 2.0, first)
    client.set("k", "v")
    del store  # the server goes
    from lightning_ft.failover.switchboard import StoreLostError
    with pytest.raises(StoreLostError, match="before any round completed"):
        for _ in range(20):
            client.set("k", "v")
    board.close()


def test_a_participant_that_left_takes_nothing_over_and_its_presence_is_gone():
    timeouts = Timeouts(failover_timeout=2.0, probe_timeout=0.2)
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=5))
    first = BoundedStore(dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                       timeout=datetime.timedelta(seconds=5)), 2.0)
    board = StoreSwitchboard(Endpoint("127.0.0.1", store.port), first, False, "me", timeouts, Signer(None))
    board.presence.start()
    board.participating = lambda: False
    from lightning_ft.failover.switchboard import Candidate, StoreLostError
    board.candidates = [Candidate("me", board.presence.endpoint)]
    client = FailoverStore(board, 2.0, first)
    del store
    with pytest.raises(StoreLostError, match="left the rendezvous"):
        for _ in range(20):
            client.set("k", "v")
    import time

    # the listener closes on its next look (a probe wakes it)
    deadline = time.monotonic() + 3.0
    while probe(board.presence.endpoint, "STATUS", 1.0, "me", board.proof).state != "dead" and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert probe(board.presence.endpoint, "STATUS", 1.0, "me", board.proof).state == "dead"
    board.close()


def test_calls_blocked_on_a_replaced_store_connection_return_when_it_is_broken():
    """What a fail-over does to the old store's connections: a recv blocked on them returns."""
    import threading

    from lightning_ft.sockets import break_connections_to

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()  # the peer never answers, like a frozen store
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(client.recv(1)), daemon=True)
    reader.start()
    try:
        assert break_connections_to(port, {"127.0.0.1"}) == 1
        reader.join(5)
        assert not reader.is_alive() and got == [b""]
        assert break_connections_to(port + 1 if port < 65535 else port - 1, {"127.0.0.1"}) == 0
    finally:
        for sock in (client, accepted, server):
            sock.close()


STORE_SERVER = """
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
print(store.port, flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_a_slow_store_that_answers_again_is_not_failed_over():
    """A store that stops answering for longer than a call's bound, with nobody able to take over
    (on an overloaded machine every presence is silent too), is waited for until the fail-over's
    deadline: when it answers again, the participant goes on with it instead of ending."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    board = None
    try:
        port = int(server.stdout.readline())
        timeouts = Timeouts(failover_timeout=6.0, probe_timeout=0.2)
        first = BoundedStore(dist.TCPStore("127.0.0.1", port, is_master=False,
                                           timeout=datetime.timedelta(seconds=10)), 1.0)
        board = StoreSwitchboard(Endpoint("127.0.0.1", port), first, False, "me", timeouts, Signer(None))
        client = FailoverStore(board, 1.0, first)
        client.set("k", "v")
        os.kill(server.pid, signal.SIGSTOP)  # slow as an overloaded store is: no answer for 2 s
        thaw = threading.Timer(2.0, os.kill, (server.pid, signal.SIGCONT))
        thaw.start()
        client.set("k", "w")
        thaw.join()
        assert board.epoch == 0 and board.failovers == []
        assert client.get("k") == b"w"
    finally:
        if board is not None:
            board.close()
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait(10)


# ------------------------------------------------------------------ issue 37: where a participant moves


def test_a_participant_follows_only_a_majority_to_an_endpoint_a_candidate_announced():
    from lightning_ft.failover.rebuild import announced_store, store_to_follow

    announced = {"10.0.0.2:4001", "10.0.0.3:4002"}
    on_b = ("alive", 1, "10.0.0.2:4001")
    assert announced_store("10.0.0.2:4001", announced) and not announced_store("", announced)
    # the frozen store host comes back: both others follow B's store
    assert store_to_follow(0, [on_b, on_b], announced) == (1, "10.0.0.2:4001")
    # a squatter on a dead peer's ports says "epoch 1 over there", the living say epoch 0: 1 of 2
    assert store_to_follow(0, [on_b, ("alive", 0, "10.0.0.1:29400")], announced) is None
    # an endpoint nobody announced is never followed, whoever names it
    assert store_to_follow(0, [("alive", 1, "6.6.6.6:1")] * 3, announced) is None
    # the gone do not vote; the silent do (they may be alive: as for the quorum)
    assert store_to_follow(0, [on_b, ("dead", -1, "")], announced) == (1, "10.0.0.2:4001")
    assert store_to_follow(0, [on_b, ("silent", -1, "")], announced) is None
    assert store_to_follow(1, [on_b, on_b], announced) is None  # not newer
    assert store_to_follow(0, [], announced) is None


def test_fail_over_keys_are_bound_to_run_incarnation_launch_and_epoch():
    from lightning_ft.schema.failover import EpochKeys, epoch_key, failover_scope

    signer = Signer(b"the secret kept across resubmissions")
    launch = failover_scope("slurm-42", 0, "ab" * 16)
    earlier = failover_scope("slurm-42", 0, "cd" * 16)  # the same job id and secret, an earlier launch
    sealed = signer.seal(EpochKeys(earlier, 1).abandoned, "no quorum")
    assert signer.unseal(EpochKeys(earlier, 1).abandoned, sealed) == b"no quorum"
    for key in (EpochKeys(launch, 1).abandoned, EpochKeys(launch, 2).abandoned,
                EpochKeys(failover_scope("slurm-42", 1, "ab" * 16), 1).abandoned,
                EpochKeys(failover_scope("other-run", 0, "ab" * 16), 1).abandoned):
        assert signer.open(key, sealed) is None  # copied under this launch's key: does not verify
    assert signer.open(epoch_key(launch), signer.seal(epoch_key(earlier), "1")) is None


def test_a_presence_announcement_is_two_endpoints_or_nothing():
    from lightning_ft.schema.failover import Announcement, decode_presence, encode_presence

    assert decode_presence(encode_presence("10.0.0.1:5000", "10.0.0.1:5001").encode()) == \
        Announcement("10.0.0.1:5000", "10.0.0.1:5001")
    for garbage in (b"10.0.0.1:5000", b"10.0.0.1:5000\x1f", b"a:1\x1fb:0", b"a:1\x1fb:x", b"a:1\x1fb:2\x1fc:3",
                    b"\xff:1\x1fb:2", b"a b:1\x1fb:2"):
        assert decode_presence(garbage) is None, garbage


def test_the_launch_id_is_the_store_hosts_and_every_reader_reads_the_same(tcp_store):
    from lightning_ft.rendezvous.records import publish_launch_id, read_launch_id
    from lightning_ft.schema.run import LAUNCH_KEY, is_launch_id

    signer = Signer(b"secret")
    store = BoundedStore(tcp_store, 5.0)
    assert read_launch_id(store, signer) == read_launch_id(store, signer)  # none published: the first reader's
    tcp_store.set(LAUNCH_KEY, "ab" * 16)  # a client without the secret writes one: replaced, not taken
    taken = read_launch_id(store, signer)
    assert taken != "ab" * 16 and is_launch_id(taken.encode())
    published = publish_launch_id(store, signer)  # a store host that starts writes its own
    assert published != taken and read_launch_id(store, signer) == published
    assert not is_launch_id(b"AB" * 16) and not is_launch_id(b"ab" * 15)


def test_a_successor_serves_on_the_port_it_announced_and_nothing_listens_there_before(switchboard):
    """When it can take none of the job's places (none is an address of this machine, here)."""
    from lightning_ft.store.locator import JobEndpoints

    board, _ = switchboard
    board.job = JobEndpoints.of(Endpoint("192.0.2.1", 29400))  # TEST-NET: binding it fails at once
    announced = parse_endpoint(board.successor)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((announced.host, announced.port), timeout=5).close()
    with pytest.raises(OSError):  # held: no other socket can take the port
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind((announced.host, announced.port))
    server, endpoint = board._serve_on_announced_port(1)
    assert endpoint == announced and server.port == announced.port
    client = dist.TCPStore(announced.host, announced.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert server.get("k") == b"v"
    from lightning_ft.failover.switchboard import StoreLostError
    with pytest.raises(StoreLostError, match="served one already"):
        board._serve_on_announced_port(2)


@pytest.mark.timeout(60)
def test_a_store_that_closes_new_connections_is_said_so_without_torch_trying():
    """A store at its descriptor limit accepts a connection and closes it at once: the connect says
    so within its bound (torch's client, which logs a C++ backtrace per try, is never pointed at it)."""
    import threading
    import time

    from lightning_ft.failover.reach import StoreClosesConnectionsError, connect, refuses_connections

    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(64)
    stop = threading.Event()

    def close_each() -> None:
        while not stop.is_set():
            try:
                conn, _ = full.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=close_each, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(StoreClosesConnectionsError, match="accepts no new connections") as caught:
            connect(Endpoint("127.0.0.1", full.getsockname()[1]), 5.0, 1.0, 0.5, 5.0)
        assert time.monotonic() - start < 10.0
    finally:
        stop.set()
        full.close()
        thread.join(5)
    assert refuses_connections(caught.value, moved=False)
    assert not refuses_connections(caught.value, moved=True)  # the store moved: try the new one
    from lightning_ft.failover.reach import StoreUnreachableError
    assert not refuses_connections(StoreUnreachableError("refused"), moved=False)


def test_asking_half_the_candidates_settles_only_what_every_answer_of_the_rest_would_settle():
    """follow_settled stops a participant after the first half of the candidates only when no
    answers of the others could make store_to_follow move it (checked over every combination)."""
    import itertools

    from lightning_ft.failover.rebuild import follow_settled, store_to_follow

    announced = {"h:2", "h:3"}
    kinds = [("dead", -1, ""), ("silent", -1, ""), ("alive", 1, "h:1"), ("alive", 2, "h:2"), ("alive", 2, "x:9"),
             ("alive", 3, "h:3")]
    settled_some = False
    for asked in (1, 2, 3, 4):
        first = (asked + 1) // 2
        for head in itertools.product(kinds, repeat=first):
            if not follow_settled(1, list(head), asked, announced):
                continue
            settled_some = True
            for tail in itertools.product(kinds, repeat=asked - first):
                assert store_to_follow(1, [*head, *tail], announced) is None, (head, tail)
    assert settled_some
    # the common case: everyone asked so far follows this process's store
    assert follow_settled(1, [("alive", 1, "h:1")] * 4, 8, announced)
    assert not follow_settled(1, [("alive", 2, "h:2")] * 4, 8, announced)


def test_a_successor_serves_at_the_first_place_of_the_job_it_can_bind(switchboard):
    """The job's endpoint is held (its store lives): the successor serves at the next port, where
    a node started later looks for it, and keeps its announced port for a later fail-over."""
    from lightning_ft.store.locator import SPREAD

    board, store = switchboard
    server, endpoint = board._serve_on_announced_port(1)
    # the next free one of the job's places (a neighbouring port may be another program's)
    assert endpoint.host == "127.0.0.1" and store.port < endpoint.port < store.port + SPREAD
    assert server.port == endpoint.port
    assert str(endpoint) in board.announced()
    assert board._reserved is not None


@pytest.mark.parametrize(("others", "moves"), [
    ({"B": (1, "b:2")}, False),                        # a job of two: the lost peer's answer alone
    ({"B": (1, "b:2"), "C": (1, "b:2")}, True),        # two of three follow it: a majority
    ({"B": (1, "b:2"), "C": (0, "")}, False),          # one of three
])
def test_following_a_newer_store_takes_a_majority_that_counts_the_asker(others, moves):
    """Issue 47, item 1: the asking process left itself out of the majority, so in a job of two
    the lost peer's forged "I follow epoch 1 over there" alone was a majority."""
    from types import SimpleNamespace

    from lightning_ft.failover.partition import follow_newest

    followed = []
    board = SimpleNamespace(
        participant_id="A", scope="s", epoch=0, announced=lambda: {"b:2"},
        candidates=[SimpleNamespace(participant_id=p) for p in ["A", *others]],
        probe=lambda c, what: SimpleNamespace(state="alive", epoch=others[c.participant_id][0],
                                              store=others[c.participant_id][1]),
        follow=lambda epoch, store: followed.append((epoch, store)) or True)
    assert follow_newest(board) is moves and followed == ([(1, "b:2")] if moves else [])

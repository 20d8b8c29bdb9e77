"""The rendezvous store fails over to a surviving participant (issue 25): real processes, real
TCPStores, real signals. Issue 37: what a store client or a squatter on a dead peer's ports can
make participants do (nothing: they move only to a successor they computed, and with a job secret
only on values bound to this launch), and a store that accepts no new connection."""

from __future__ import annotations

import datetime
import os
import resource
import signal
import socket
import sys
import threading
import time

import pytest
import torch.distributed as dist

from lightning_ft.schema.failover import EpochKeys, decode_presence, epoch_key, failover_scope, presence_key
from lightning_ft.schema.run import LAUNCH_KEY, RunKeys
from lightning_ft.schema.signing import MAGIC, TAG_BYTES, Signer

from proc_utils import REPO_ROOT, write_secret

sys.path.insert(0, str(REPO_ROOT / "tests" / "scripts"))
from ft_cluster import Cluster, base_env, in_order, ordered_start, release

pytestmark = [pytest.mark.multiprocess]

SLOW = ["--step-sleep", "0.03", "--snapshot-every", "10"]
OPEN_ROUND = "lightning_ft.runtime.session:Session.open_round"
PROPOSE = "lightning_ft.termination.coordination:StoreStopCoordinator.propose"


def three(processes, tmp_path, args: list[str], standalone: bool = True, **env: str) -> Cluster:
    """2 actives (A, B) + 1 spare (C), with a standalone store or (``standalone=False``) A hosting it."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    if standalone:
        cluster.start_store(**env)
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("ABC"):
        cluster.start_participant(name, [*args, *hold], LIGHTNING_FT_INFRA_RANK=str(infra_rank), **env)
        if name == "A" and not standalone:
            cluster.wait_for_log("A", "hosting the rendezvous store")
        in_order(cluster, name, actives="AB")
    release(hold)
    return cluster


@pytest.mark.timeout(150)
@pytest.mark.parametrize("secret", ["no-secret", "job-secret"])
def test_store_hosting_participant_killed(processes, tmp_path, secret):
    """The participant that hosts the store (the default launch) is SIGKILLed mid-training: the
    store fails over to a survivor, the spare takes the dead rank's place, the job finishes 0.
    With a job secret every rebuilt value is sealed as before: none is refused."""
    env = {"LIGHTNING_FT_SECRET": "a-secret-for-this-test"} if secret == "job-secret" else {}
    cluster = three(processes, tmp_path, ["--max-steps", "150", *SLOW], standalone=False, **env)
    cluster.wait_for_step(50, 60)
    cluster.kill("A")
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert cluster.result("B")["step"] == 150
    for name in "BC":
        assert cluster.left_cleanly(name), cluster.procs[name].log()
        assert "ignored the value" not in cluster.procs[name].log(), cluster.procs[name].log()


@pytest.mark.timeout(150)
def test_standalone_store_killed_then_a_peer(processes, tmp_path):
    """`lightning-ft store` is SIGKILLed, then an active: the store fails over to a participant,
    and the peer's death after it recovers with the spare on the new store."""
    cluster = three(processes, tmp_path, ["--max-steps", "200", *SLOW])
    cluster.wait_for_step(40, 60)
    os.kill(cluster.stores["store"].pid, signal.SIGKILL)
    cluster.wait_for_step(90, 60)
    cluster.kill("A")
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert cluster.result("B")["step"] == 200


@pytest.mark.timeout(180)
def test_frozen_store_host_then_its_return_never_makes_two_deciding_stores(processes, tmp_path):
    """SIGSTOP of the participant that hosts the store (a frozen peer and a frozen store at once):
    the others fail over (bounded by the store operation timeout of the watchdog), recover with
    the spare and finish. Thawed, the old host finds the others on the new store (its presence
    probes) instead of deciding alone on its own: it never trains a round of its own again."""
    cluster = three(processes, tmp_path, ["--max-steps", "400", *SLOW, "--hang-floor", "60"], standalone=False)
    cluster.wait_for_step(30, 60)
    cluster.kill("A", signal.SIGSTOP)
    try:
        cluster.wait_for_step(60, 90, among=["C"])
    finally:
        os.kill(cluster.procs["A"].pid, signal.SIGCONT)
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.result("B")["step"] == 400 and cluster.result("C")["step"] == 400
    assert cluster.wait(["A"], 60)["A"] is not None, cluster.logs()
    late = cluster.result("A")  # it never trained again: at most it left as a spare of the new store
    assert late is None or late["rank"] == -1, (late, cluster.logs())
    pid_of_a = cluster.procs["A"].pid
    active_rounds_of_a = [e["round"] for e in cluster.events_of("round_complete")
                          if e["pid"] == pid_of_a and not e["standby"]]
    assert active_rounds_of_a == [0], active_rounds_of_a


@pytest.mark.timeout(180)
def test_a_store_host_thawed_before_it_was_judged_follows_the_store_the_others_moved_to(processes, tmp_path):
    """A (active, hosting the store) is frozen; B and C fail over to a store of their own; A is
    thawed right then, before anyone judged it: A and B train on together (a watchdog reads
    heartbeats only while its rank cannot progress). A's own clients still reached the store A
    serves, so nothing told A that the job had moved: when B was killed next, A recovered on its
    stale store and C on the new one, never meeting again -- the job was lost (found by the chaos
    test: 81). A store host that was frozen now asks the others which store they follow as it
    thaws: A and C recover together and finish."""
    cluster = three(processes, tmp_path, ["--max-steps", "500", *SLOW, "--hang-floor", "60"], standalone=False)
    cluster.wait_for_step(30, 60)
    cluster.kill("A", signal.SIGSTOP)
    try:
        cluster.wait_for_log("B", "failed over to", 60)
    finally:
        os.kill(cluster.procs["A"].pid, signal.SIGCONT)
    step = max(r["step"] for r in cluster.steps()["B"])
    cluster.wait_for_step(step + 60, 60, among=["A"])  # A trains on with B
    cluster.kill("B")
    codes = cluster.wait(["A", "C"], 120)
    assert codes == {"A": 0, "C": 0}, cluster.logs()
    assert cluster.result("A")["step"] == 500 and cluster.result("C")["step"] == 500, cluster.logs()


def two_with_a_store(processes, tmp_path, steps: int) -> Cluster:
    """2 actives (A, B), no spare, a standalone store."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    cluster.start_store()
    for name in "AB":
        cluster.start_participant(name, ["--max-steps", str(steps), *SLOW])
    return cluster


def committed_decisions(cluster: Cluster, tmp_path) -> dict[str, dict]:
    """Each rank's termination decision; an 81 only with a committed snapshot of its step."""
    decisions = {event["who"]: event for event in cluster.events_of("termination_decision")}
    for event in decisions.values():
        if event["exit_code"] == 81:
            assert list(tmp_path.glob(f"shm-*/**/step-{event['step']:012d}.snap")), event
    return decisions


@pytest.mark.timeout(150)
def test_sigterm_after_a_failover_agrees_a_stop_step_and_exits_81(processes, tmp_path):
    """The store is lost and taken over; then SIGTERM reaches both ranks: they agree on one stop
    step through the new store, snapshot it and exit 81."""
    cluster = two_with_a_store(processes, tmp_path, 100_000)
    cluster.wait_for_step(30, 60)
    os.kill(cluster.stores["store"].pid, signal.SIGKILL)
    cluster.wait_for_log("A", "failed over to", 30)
    cluster.wait_for_log("B", "failed over to", 30)
    cluster.wait_for_step(max(r[-1]["step"] for r in cluster.steps().values()) + 5, 30)  # training goes on
    cluster.kill("A", signal.SIGTERM)
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B"], 60)
    assert codes == {"A": 81, "B": 81}, cluster.logs()
    decisions = committed_decisions(cluster, tmp_path)
    assert len(decisions) == 2 and len({e["step"] for e in decisions.values()}) == 1, decisions
    assert all(e["reasons"] and "agreed" in e["reasons"][0] for e in decisions.values()), decisions


@pytest.mark.timeout(150)
def test_store_killed_during_the_sigterm_agreement_ends_truthfully(processes, tmp_path):
    """SIGTERM to both ranks; the store is SIGKILLed right when the first rank proposes the stop
    step (a fault injected there): each rank ends in bounded time with a truthful code -- 81
    only with a committed snapshot of the step it decided."""
    cluster = Cluster(processes, tmp_path, "2:2")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    fault = ["--fault", f"store-kill:{PROPOSE}"]
    for name in "AB":
        cluster.start_participant(name, ["--max-steps", "100000", *SLOW, *fault], FT_TEST_STORE_PID=str(store.pid))
    cluster.wait_for_step(30, 60)
    cluster.kill("A", signal.SIGTERM)
    time.sleep(0.05)
    cluster.kill("B", signal.SIGTERM)
    codes = cluster.wait(["A", "B"], 60)
    assert set(codes.values()) <= {81, 143}, cluster.logs()
    committed_decisions(cluster, tmp_path)
    for name in "AB":
        assert "Traceback" not in cluster.procs[name].log(), cluster.procs[name].log()


@pytest.mark.timeout(150)
def test_store_killed_during_a_recovery_fails_over_and_the_recovery_goes_on(processes, tmp_path):
    """A peer dies; the store is SIGKILLed right when the survivor opens the next round (a fault
    injected there): the store fails over to the survivor or the spare, the recovery goes on on
    it and the job finishes 0."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("ABC"):
        fault = ["--fault", f"store-kill:{OPEN_ROUND}"] if name == "B" else []
        cluster.start_participant(name, ["--max-steps", "200", *SLOW, *fault, *hold],
                                  LIGHTNING_FT_INFRA_RANK=str(infra_rank), FT_TEST_STORE_PID=str(store.pid))
        in_order(cluster, name, actives="AB")
    release(hold)
    cluster.wait_for_step(40, 60)
    cluster.kill("A")
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert "FAULT store-kill" in cluster.procs["B"].log(), cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert cluster.result("B")["step"] == 200


# ------------------------------------------------------------------ issue 37

SQUATTER = str(REPO_ROOT / "tests" / "scripts" / "failover_squatter.py")
#: an earlier launch of the same job id (a resubmission keeps the run id and the secret file)
EARLIER_LAUNCH = "e0" * 16


def plain(raw: bytes) -> bytes:
    """A stored value without its seal (sealed is not encrypted: any store client reads it)."""
    return raw[len(MAGIC) + TAG_BYTES:] if raw.startswith(MAGIC) else raw


def secret_env(tmp_path, secret: str) -> dict[str, str]:
    return {"LIGHTNING_FT_SECRET_FILE": write_secret(tmp_path)} if secret == "job-secret" else {}


def store_client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))


def participant_id(cluster: Cluster, name: str) -> str:
    return f"{socket.gethostname()}:{cluster.procs[name].pid}:0"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("secret", ["no-secret", "job-secret"])
def test_after_a_peer_loss_a_squatter_with_a_newer_store_is_not_followed(processes, tmp_path, secret):
    """Issue 37 finding 2. An active dies (an ordinary peer loss; the store lives). A process on its
    host takes over both ports it announced -- its presence port and the port it held for a
    successor store --, answers every probe as the dead peer ("alive, I follow the store of epoch 1
    over there") and serves a store there whose epoch value verifies as well as an attacker can make
    it: a plain "1" without a secret; with one, the sealed value of an earlier launch's fail-over
    under the same secret. The survivor asks it (the squatter answered) and stays on its store: a
    newer store is followed only with a majority of the candidates behind it (with a secret the
    answer is not even authentic). The spare takes the dead peer's place and the job finishes 0."""
    env = secret_env(tmp_path, secret)
    cluster = three(processes, tmp_path, ["--max-steps", "150", *SLOW], **env)
    cluster.wait_for_step(30, 60)
    victim = participant_id(cluster, "A")
    if secret == "job-secret":
        sealer = Signer(open(env["LIGHTNING_FT_SECRET_FILE"], "rb").read().strip())
        epoch_value = sealer.seal(epoch_key(failover_scope(cluster.run_id, 0, EARLIER_LAUNCH)), "1")
    else:
        epoch_value = b"1"
    squatter = processes.start("squatter", [sys.executable, SQUATTER, "--endpoint", f"127.0.0.1:{cluster.port}",
                                            "--run-id", cluster.run_id, "--victim", victim,
                                            "--epoch-value", epoch_value.hex(), "--seconds", "60"], env=base_env())
    wait_for_output(squatter, "ready")
    # the survivors see the loss only once the squatter holds the ports: a real squatter is quick,
    # this one must not lose a race with the machine's load
    for name in "BC":
        os.kill(cluster.procs[name].pid, signal.SIGSTOP)
    try:
        cluster.kill("A")
        wait_for_output(squatter, "squatting")
    finally:
        for name in "BC":
            os.kill(cluster.procs[name].pid, signal.SIGCONT)
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs() + squatter.log()
    assert "answered 1" in squatter.log(), squatter.log()  # the survivor asked it: the attack was made
    assert cluster.events_of("store_failover") == [], cluster.logs()
    assert "failed over to" not in cluster.logs()
    assert cluster.result("B")["step"] == 150 and cluster.result("C")["step"] == 150
    squatter.popen.send_signal(signal.SIGTERM)
    squatter.popen.wait(30)
    assert "keys others wrote to its store: 0" in squatter.log(), squatter.log()


@pytest.mark.timeout(180)
def test_in_a_job_of_two_a_squatter_on_the_lost_peers_ports_moves_nobody(processes, tmp_path):
    """Issue 47, item 1 (no secret). Elastic 1:2, A hosts the store; B dies and a process on its
    host takes over its ports and answers "alive, I follow epoch 1 over there". The majority rule
    left A itself out, so B's forged answer alone was a majority: A moved its store into the
    attacker's (22 of the job's keys written there). A counts itself now, a voter that stays: it
    goes on alone (the job shrinks) on its own store and finishes."""
    cluster = Cluster(processes, tmp_path, "1:2")
    cluster.out.mkdir(parents=True)
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("AB"):
        cluster.start_participant(name, ["--max-steps", "150", *SLOW, *hold], LIGHTNING_FT_INFRA_RANK=str(infra_rank))
        if name == "A":
            cluster.wait_for_log("A", "hosting the rendezvous store")
    in_order(cluster, "B", actives="AB")
    release(hold)
    cluster.wait_for_step(30, 60)
    squatter = processes.start("squatter", [sys.executable, SQUATTER, "--endpoint", f"127.0.0.1:{cluster.port}",
                                            "--run-id", cluster.run_id, "--victim", participant_id(cluster, "B"),
                                            "--epoch-value", b"1".hex(), "--seconds", "60"], env=base_env())
    wait_for_output(squatter, "ready")
    os.kill(cluster.procs["A"].pid, signal.SIGSTOP)  # A sees the loss only once the squatter holds the ports
    try:
        cluster.kill("B")
        wait_for_output(squatter, "squatting")
    finally:
        os.kill(cluster.procs["A"].pid, signal.SIGCONT)
    assert cluster.wait(["A"], 90) == {"A": 0}, cluster.logs() + squatter.log()
    # A is one of the two voters and stays: no answer could make a majority, so it asks none (the
    # code before asked the squatter and moved)
    assert "failed over to" not in cluster.logs() and cluster.result("A")["step"] == 150
    squatter.popen.send_signal(signal.SIGTERM)
    squatter.popen.wait(30)
    assert "keys others wrote to its store: 0" in squatter.log(), squatter.log()


def wait_for_output(proc, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log():
        assert proc.popen.poll() is None and time.monotonic() < deadline, proc.log()
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_fail_over_values_of_an_earlier_launch_do_not_verify_and_the_fail_over_completes(processes, tmp_path):
    """Issue 37 finding 2, with a job secret. The participant hosting the store dies; while the
    successor waits for its quorum, a store client writes there the sealed "abandoned" of an
    earlier launch's fail-over of the same job id under the same secret: under this launch's key
    (and under the key the code before issue 37 read). Fail-over values are bound to the run, its
    incarnation, this launch and the epoch: the copy fails its check and is ignored (logged), the
    spare registers, the store opens and the job finishes 0."""
    env = secret_env(tmp_path, "job-secret")
    sealer = Signer(open(env["LIGHTNING_FT_SECRET_FILE"], "rb").read().strip())
    cluster = three(processes, tmp_path, ["--max-steps", "150", *SLOW], standalone=False, **env)
    cluster.wait_for_step(30, 60)
    first = store_client(cluster.port)
    launch = plain(first.get(LAUNCH_KEY)).decode()
    announced = decode_presence(plain(first.get(presence_key(RunKeys(cluster.run_id, 0).prefix,
                                                             participant_id(cluster, "B")))))
    assert announced is not None and launch != EARLIER_LAUNCH
    earlier = EpochKeys(failover_scope(cluster.run_id, 0, EARLIER_LAUNCH), 1).abandoned
    before_issue_37 = "lightning_ft_failover/e1/abandoned"
    replays = {EpochKeys(failover_scope(cluster.run_id, 0, launch), 1).abandoned: sealer.seal(earlier, "no quorum"),
               before_issue_37: sealer.seal(before_issue_37, "no quorum")}
    del first
    # the spare stays away until the replay is in place: the successor (B, next in the order)
    # waits for it, a quorum being B and C
    os.kill(cluster.procs["C"].pid, signal.SIGSTOP)
    try:
        cluster.kill("A")
        # the successor serves at the job's endpoint, free once A died (it shares A's host)
        successor = wait_for_store(f"127.0.0.1:{cluster.port}", 30)
        for key, value in replays.items():
            successor.set(key, value)
    finally:
        os.kill(cluster.procs["C"].pid, signal.SIGCONT)
    codes = cluster.wait(["B", "C"], 90)
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert "ignored the value of store key lightning_ft_failover/" in cluster.procs["C"].log(), cluster.logs()
    assert "gave up" not in cluster.logs()
    assert cluster.result("B")["step"] == 150 and cluster.result("C")["step"] == 150


def wait_for_store(endpoint: str, timeout: float) -> dist.TCPStore:
    """A client of the store that will serve at ``endpoint`` (refused until it listens)."""
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"nothing served at {endpoint}"
            time.sleep(0.02)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))


def descriptors(pid: int) -> list[int]:
    return sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(180)
def test_a_store_that_accepts_no_new_connection_ends_the_job_with_83_saying_so(processes, tmp_path):
    """Issue 37 finding 7. Another user holds idle connections to the store from before the job
    started, and the store's file-descriptor limit is reached: every descriptor below it is taken
    (here: the limit is lowered to just above them once the job trains), so the store answers on
    the connections it has and closes every new one at once. A peer dies: recovering needs new
    connections. The store never moved, so that is no fail-over: the survivor ends with 83 and a
    message naming the store and why, without a traceback or torch's C++ backtraces."""
    cluster = Cluster(processes, tmp_path, "2:3")
    cluster.out.mkdir(parents=True)
    store = cluster.start_store()
    before = len(descriptors(store.pid))
    idle = [socket.create_connection(("127.0.0.1", cluster.port), timeout=10) for _ in range(32)]
    deadline = time.monotonic() + 30
    while len(descriptors(store.pid)) < before + len(idle):  # accepted: each holds a descriptor of the store's
        assert time.monotonic() < deadline, descriptors(store.pid)
        time.sleep(0.05)
    taken = max(descriptors(store.pid))
    hold = ordered_start(cluster, "AB")
    for infra_rank, name in enumerate("ABC"):
        cluster.start_participant(name, ["--max-steps", "100000", *SLOW, *hold],
                                  LIGHTNING_FT_INFRA_RANK=str(infra_rank))
        in_order(cluster, name, actives="AB")
    release(hold)
    cluster.wait_for_step(30, 60)
    # from here on a new descriptor would have to be numbered below the idle connections' last
    resource.prlimit(store.pid, resource.RLIMIT_NOFILE, (taken + 1, taken + 1))
    cluster.kill("A")
    codes = cluster.wait(["B", "C"], 120)
    assert codes["B"] == 83, cluster.logs()
    assert "accepts no new connections (file-descriptor limit?)" in cluster.procs["B"].log(), cluster.logs()
    assert f"127.0.0.1:{cluster.port}" in cluster.procs["B"].log()
    assert codes["C"] in (0, 83), cluster.logs()
    for name in "BC":
        log = cluster.procs[name].log()
        assert "Traceback" not in log and "kept moving" not in log, log
    assert cluster.events_of("store_failover") == [], cluster.logs()
    for sock in idle:
        sock.close()


# ---------------------------------------------------------------- issue 37: the presence channel under attack


def announced_presence(cluster: Cluster, name: str) -> str:
    """The presence endpoint ``name`` announced when it joined (any store client can read it)."""
    from lightning_ft.schema.run import incarnation_key

    store = store_client(cluster.port)
    incarnation = int(plain(store.get(incarnation_key(cluster.run_id))))
    key = presence_key(RunKeys(cluster.run_id, incarnation).prefix, participant_id(cluster, name))
    announced = decode_presence(plain(store.get(key)))
    assert announced is not None
    return announced.presence


class ListenerPressure:
    """What another local user can do to a presence listener without any secret, kept up until
    :meth:`stop`: the 12-byte line that killed the listener before issue 37 (``FAILOVER ²``: a
    digit to ``str.isdigit`` that ``int`` refuses), 40 idle connections at a time, and 2 clients
    that trickle one byte every 0.4 s."""

    def __init__(self, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        self.address = (host, int(port))
        self.stopping = threading.Event()
        self.sent_lines = 0
        self.held = 0
        self.threads = [threading.Thread(target=self._idle, daemon=True),
                        *(threading.Thread(target=self._trickle, daemon=True) for _ in range(2))]
        with socket.create_connection(self.address, timeout=5) as sock:
            sock.sendall("FAILOVER ²\n".encode())
            self.sent_lines += 1
        for thread in self.threads:
            thread.start()

    def _idle(self) -> None:
        while not self.stopping.is_set():
            held = []
            for _ in range(40):
                try:
                    held.append(socket.create_connection(self.address, timeout=1))
                except OSError:
                    break
            self.held = max(self.held, len(held))
            self.stopping.wait(0.3)
            for sock in held:
                sock.close()

    def _trickle(self) -> None:
        while not self.stopping.is_set():
            try:
                with socket.create_connection(self.address, timeout=1) as sock:
                    for byte in b"STATUS 0123456789abcdef0123456789abcdef\n":
                        sock.sendall(bytes([byte]))
                        if self.stopping.wait(0.4):
                            return
            except OSError:
                self.stopping.wait(0.1)  # dropped at its deadline: connect again

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(5)


class Squatter:
    """A process's listener on a dead participant's presence port that answers every probe with
    the answer the participant gave earlier (copied by anyone who asked once)."""

    def __init__(self, endpoint: str, answer: bytes) -> None:
        host, _, port = endpoint.rpartition(":")
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind((host, int(port)))
        self.server.listen(16)
        self.server.settimeout(0.1)
        self.answer, self.answered = answer, 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.settimeout(1)
                    conn.recv(256)
                    conn.sendall(self.answer)
                    self.answered += 1
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.server.close()


def copied_answer(endpoint: str) -> bytes:
    """What the participant at ``endpoint`` answers one STATUS probe (its own nonce, any nonce)."""
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"STATUS 00112233445566778899aabbccddeeff\n")
        sock.settimeout(5)
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = sock.recv(4096)
            assert chunk, answer
            answer += chunk
    return answer


@pytest.mark.timeout(180)
@pytest.mark.parametrize("secret", ["no-secret", "job-secret"])
def test_the_presence_channel_under_attack_still_carries_the_fail_over(processes, tmp_path, secret):
    """Issue 37 findings 1, 3, 4 and 5 in one real job: before the store host dies, the survivors'
    presence listeners get the line that killed them (`FAILOVER ²`), 40 idle and 2 trickling
    connections each, kept up through the fail-over; the store host's presence port is taken
    over at its death by a squatter that replays the answer it gave. The listeners keep
    answering, the squatter counts as gone (not as a living voter that never registers), the
    store fails over to a survivor and the job finishes 0. Before: a dead listener, probes held
    for minutes, a quorum missed -- exit 83."""
    env = secret_env(tmp_path, secret)
    cluster = three(processes, tmp_path, ["--max-steps", "150", *SLOW], standalone=False, **env)
    cluster.wait_for_step(30, 60)
    endpoints = {name: announced_presence(cluster, name) for name in "ABC"}
    replayed = copied_answer(endpoints["A"])
    pressure = [ListenerPressure(endpoints[name]) for name in "BC"]
    squatter = None
    try:
        # the survivors notice the loss only once the squatter holds the port (a real one is
        # quick; this one must not lose a race with the machine's load)
        for name in "BC":
            os.kill(cluster.procs[name].pid, signal.SIGSTOP)
        try:
            cluster.kill("A")
            cluster.wait(["A"], 30)
            squatter = Squatter(endpoints["A"], replayed)
        finally:
            for name in "BC":
                os.kill(cluster.procs[name].pid, signal.SIGCONT)
        codes = cluster.wait(["B", "C"], 120)
    finally:
        for attack in pressure:
            attack.stop()
        if squatter is not None:
            squatter.stop()
    assert codes == {"B": 0, "C": 0}, cluster.logs()
    assert cluster.events_of("store_failover"), cluster.logs()
    assert cluster.result("B")["step"] == 150 and cluster.result("C")["step"] == 150
    assert all(attack.held == 40 for attack in pressure), [attack.held for attack in pressure]
    assert squatter is not None and squatter.answered >= 1  # the survivors asked it: its answer was judged
    assert "Exception in thread" not in cluster.logs(), cluster.logs()

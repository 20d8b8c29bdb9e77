"""The presence protocol: how the others learn, during a store fail-over, whether a participant
is alive and which store it follows (see :mod:`lightning_ft.failover.switchboard`).

A refused connection proves the process gone (its host's kernel says so); anything else that
is not an authentic answer -- no answer, a late one, a malformed one, one for another
participant or launch, one that fails its check -- is *silent*, never *alive*.

The protocol, one request and one answer per connection, each a line ending in ``\\n``:

* request (ASCII, at most :data:`MAX_REQUEST` bytes with its newline): ``STATUS <nonce>``, or
  ``FAILOVER <epoch> <nonce>`` (the store of that epoch is lost: check it). ``<epoch>`` is
  ASCII digits (at most 18), ``<nonce>`` 16 to 64 lowercase hex digits, fresh and random per
  probe. Anything else is dropped unanswered.
* answer (ASCII JSON, at most :data:`MAX_ANSWER` bytes): ``{"epoch", "store", "participant",
  "run", "incarnation", "launch", "nonce", "mac"}`` -- the epoch and the store (host:port) this
  process follows (or serves during its own fail-over), who answers (participant id), for which
  launch (run id, incarnation and the launch's random id, which the store's host made when the
  store started: :func:`~lightning_ft.rendezvous.records.read_launch_id`), the request's nonce,
  and ``mac``: HMAC-SHA256 over all of it (:meth:`PresenceProof.mac`) with a key derived from
  the job secret (HKDF, a label of its own), or ``""`` without a secret.

A prober counts a peer alive only when the answer names the participant and launch it asked
for and echoes its nonce; with a job secret, also only when the MAC verifies (constant-time
compare). So a process that took over a dead participant's port (another job's listener, a
listener of an earlier launch under the same secret, a restarted participant, an old copy of an
answer replayed) is silent, not a living voter. An alive answer only says which store the peer
follows; where a participant moves is still only an endpoint a candidate announced (see
:mod:`~lightning_ft.failover.switchboard`).

Residual risk without a job secret: the check then proves only that whatever answers knows the
participant id, run id and launch id (all readable by any client of the store) and speaks this
protocol -- it stops accidents (a port reused by another process, a replayed answer), not an
attacker who answers for a dead participant on purpose and so can keep it counted as alive (or
say that it follows a newer store: which a participant follows only when a majority of the
candidates it asks say so, at an endpoint a candidate announced; see the switchboard).
With a secret, such an answer needs the secret (whoever holds it is a participant of the job and
can do what the job's processes can). Either way requests are not authenticated: any
client can learn a participant's epoch and store endpoint (the store says as much) and make it
check its store (one check at a time), and whoever can forge a TCP reset or hold a port can
make a participant look gone or silent (a denial of service, as for the store itself).

The listener is :class:`~lightning_ft.failover.listener.Presence`; this module is the protocol
and the probe.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from lightning_ft._clock import monotonic
from lightning_ft.schema.signing import Signer
from lightning_ft.store.tcp import Endpoint, parse_endpoint

log = logging.getLogger(__name__)

#: the longest request line, its newline included
MAX_REQUEST = 128
#: the longest answer line, its newline included
MAX_ANSWER = 4096
_LABEL = b"lightning_ft/presence/v1"
_FIELDS = frozenset({"epoch", "store", "participant", "run", "incarnation", "launch", "nonce", "mac"})
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdef")


class PresenceRequest(NamedTuple):
    """A parsed request: ``epoch`` is None for ``STATUS``, the lost store's for ``FAILOVER``."""

    epoch: int | None
    nonce: str


def _is(text: bytes, alphabet: frozenset[int], least: int, most: int) -> bool:
    return least <= len(text) <= most and all(byte in alphabet for byte in text)


def parse_request(line: bytes) -> PresenceRequest | None:
    """The request in ``line`` (without its newline), or None unless it is exactly one of the
    two forms. Strict on purpose: bytes are checked against ASCII digits and hex digits (never
    ``str.isdigit``, which takes '²' and other digits ``int`` refuses)."""
    if len(line) >= MAX_REQUEST:
        return None
    words = line.split(b" ")
    if len(words) == 2 and words[0] == b"STATUS" and _is(words[1], _HEX, 16, 64):
        return PresenceRequest(None, words[1].decode("ascii"))
    if len(words) == 3 and words[0] == b"FAILOVER" and _is(words[1], _DIGITS, 1, 18) and _is(words[2], _HEX, 16, 64):
        return PresenceRequest(int(words[1]), words[2].decode("ascii"))
    return None


def request_line(request: str, nonce: str) -> bytes:
    """The line a probe sends: ``request`` ("STATUS" or "FAILOVER <epoch>") and its nonce."""
    line = f"{request} {nonce}".encode("ascii")
    if parse_request(line) is None:
        raise ValueError(f"not a presence request: {request!r}")
    return line + b"\n"


class PeerStatus(NamedTuple):
    """What a presence probe found: ``state`` "dead" (refused, or a whole answer that is not the
    participant's: another process holds its port), "silent" (no whole answer in time) or
    "alive"; an alive peer follows the store of ``epoch`` at ``store`` (host:port)."""

    state: str
    epoch: int = -1
    store: str = ""


class NotAuthentic(ValueError):
    """A presence answer that does not prove who speaks; the message says why."""


class PresenceProof:
    """What a presence answer proves, for one launch (``run_id``, ``incarnation``, ``launch_id``)
    of a job: its MAC key is derived from the job secret of ``signer`` (None, or a signer without
    a secret: the plain protocol, see the module's residual risk). Listener and prober use the
    same one."""

    def __init__(self, signer: Signer | None = None, run_id: str = "", incarnation: int = 0,
                 launch_id: str = "") -> None:
        self._key = signer.derived_key(_LABEL) if signer is not None else None
        self.run_id, self.incarnation, self.launch_id = run_id, incarnation, launch_id

    @property
    def authenticated(self) -> bool:
        """Answers carry (and must carry) a MAC made with the job secret."""
        return self._key is not None

    def mac(self, participant_id: str, epoch: int, store: str, nonce: str) -> str:
        """HMAC-SHA256 (hex) over every field of an answer; ``""`` without a secret."""
        if self._key is None:
            return ""
        # a JSON list: no field can run into the next (unlike a plain join)
        fields = [_LABEL.decode(), participant_id, self.run_id, self.incarnation, self.launch_id, epoch, store, nonce]
        message = json.dumps(fields, separators=(",", ":")).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def answer(self, participant_id: str, epoch: int, store: str, nonce: str) -> bytes:
        """The answer line of ``participant_id`` to a request that carried ``nonce``."""
        fields = {"epoch": epoch, "store": store, "participant": participant_id, "run": self.run_id,
                  "incarnation": self.incarnation, "launch": self.launch_id, "nonce": nonce,
                  "mac": self.mac(participant_id, epoch, store, nonce)}
        return json.dumps(fields, separators=(",", ":")).encode("ascii") + b"\n"

    def check(self, line: bytes, participant_id: str, nonce: str) -> PeerStatus:
        """"alive" when ``line`` is the authentic answer of ``participant_id`` of this launch to the
        request that carried ``nonce``; else "dead" (logged at debug, saying why): a whole answer
        that does not prove who speaks comes from a process that is not that participant (a
        squatter on its port, another job's listener), so the participant is gone -- counted as
        a living voter, such a squatter could deny a fail-over its quorum."""
        try:
            epoch, store = self.verify(line, participant_id, nonce)
        except NotAuthentic as exc:
            log.debug("presence answer for %s not taken (not that participant: gone): %s", participant_id, exc)
            return PeerStatus("dead")
        return PeerStatus("alive", epoch, store)

    def verify(self, line: bytes, participant_id: str, nonce: str) -> tuple[int, str]:
        """``(epoch, store)`` of an authentic answer; NotAuthentic saying why it is not one."""
        try:
            fields = json.loads(line.decode("ascii")) if len(line) < MAX_ANSWER else None
        except (UnicodeDecodeError, ValueError, RecursionError):
            fields = None
        if not isinstance(fields, dict) or set(fields) != _FIELDS:
            raise NotAuthentic("not a presence answer")
        epoch, store = fields["epoch"], fields["store"]
        if not _number(epoch) or not _number(fields["incarnation"]) or \
                not all(isinstance(fields[k], str) for k in ("store", "participant", "run", "launch", "nonce", "mac")):
            raise NotAuthentic("a field of the wrong type")
        if not _same(fields["nonce"], nonce):
            raise NotAuthentic("it does not echo this probe's nonce (an old answer, or not ours)")
        if (fields["participant"], fields["run"], fields["incarnation"], fields["launch"]) != \
                (participant_id, self.run_id, self.incarnation, self.launch_id):
            raise NotAuthentic(f"it answers for participant {fields['participant']!r} of run {fields['run']!r}, "
                               f"incarnation {fields['incarnation']}, launch {fields['launch'][:40]!r}")
        if self.authenticated and not _same(fields["mac"], self.mac(participant_id, epoch, store, nonce)):
            raise NotAuthentic("its MAC does not match the job secret")
        if not _endpoint(store):
            raise NotAuthentic(f"no store endpoint: {store[:80]!r}")
        return epoch, store


def _number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _same(given: str, expected: str) -> bool:
    """Constant-time equality of two strings (either may hold any code point)."""
    return hmac.compare_digest(given.encode(errors="backslashreplace"), expected.encode(errors="backslashreplace"))


def _endpoint(text: str) -> bool:
    if not 0 < len(text) <= 300 or not text.isascii() or not text.isprintable() or " " in text:
        return False
    try:
        parse_endpoint(text)
    except ValueError:
        return False
    return True


def probe(endpoint: str, request: str, timeout: float, participant_id: str, proof: PresenceProof) -> PeerStatus:
    """Ask the presence listener of ``participant_id`` at ``endpoint``: ``request`` is ``STATUS``,
    or ``FAILOVER <epoch>`` (the store of that epoch is lost, check it). Returns within
    ``timeout`` in all -- connect, send and the whole answer share one deadline, so a listener
    that trickles its answer cannot hold the probe -- and "alive" only for an answer that
    ``proof`` takes as authentic."""
    deadline = monotonic() + timeout
    nonce = secrets.token_hex(16)
    line = request_line(request, nonce)
    try:
        target = parse_endpoint(endpoint)
        with socket.create_connection((target.host, target.port), timeout=timeout) as sock:
            answer = _exchange(sock, line, deadline)
    except ConnectionRefusedError:
        return PeerStatus("dead")
    except (OSError, ValueError):
        return PeerStatus("silent")
    if answer is None:
        return PeerStatus("silent")
    return proof.check(answer, participant_id, nonce)


def refuses(endpoint: str, timeout: float) -> bool:
    """Whether the host of ``endpoint`` refuses a connection to it: nothing listens there, proof
    that the participant whose presence listener it was has ended (or left). Connects only. A
    frozen process still accepts (its kernel does) and an unreachable host does not answer within
    ``timeout``: neither proves anything, both are False."""
    try:
        target = parse_endpoint(endpoint)
        with socket.create_connection((target.host, target.port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


_Asked = TypeVar("_Asked")
_Answer = TypeVar("_Answer")

#: at most this many peers are asked at once (each probe is bounded by its own timeout)
PARALLEL_PROBES = 16


def ask_each(asked: Sequence[_Asked], ask: Callable[[_Asked], _Answer], name: str = "probe") -> list[_Answer]:
    """``ask(a)`` for each of ``asked``, in parallel threads (one wave of at most
    :data:`PARALLEL_PROBES`), the answers in the order asked: a dead peer's probe waits out its
    timeout beside the others instead of after them."""
    if not asked:
        return []
    with ThreadPoolExecutor(max_workers=min(PARALLEL_PROBES, len(asked)),
                            thread_name_prefix=f"lightning_ft-{name}") as pool:
        return list(pool.map(ask, asked))


def _exchange(sock: socket.socket, line: bytes, deadline: float) -> bytes | None:
    """Send ``line`` and read one answer line (without its newline) by ``deadline``; None when
    none came whole in time, or it is too long."""
    answer = b""
    sent = False
    while True:
        remaining = deadline - monotonic()  # recomputed before every call: the deadline is overall
        if remaining <= 0:
            return None
        sock.settimeout(remaining)
        if not sent:
            sock.sendall(line)
            sent = True
            continue
        chunk = sock.recv(MAX_ANSWER - len(answer))
        if not chunk:
            return None
        answer += chunk
        if b"\n" in answer:
            return answer.partition(b"\n")[0]
        if len(answer) >= MAX_ANSWER:
            return None


def local_address_towards(endpoint: Endpoint) -> str:
    """This host's address on the route to ``endpoint``: where peers that reach the store reach us."""
    try:
        family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((endpoint.host, endpoint.port))  # UDP: no packet is sent
            return str(sock.getsockname()[0])
    except OSError:
        return socket.gethostname()

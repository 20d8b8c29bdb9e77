"""Authenticating control-plane values with the job's secret.

Anyone who can reach a job's TCPStore can write any key. Every value that changes what a
participant does -- a slot, a rank assignment, "closed for good", a stop step, a failure
notice, a snapshot replica -- is therefore *sealed*: ``MAGIC + HMAC-SHA256(secret, key,
value)[:16] + value``. The key name is part of the MAC, so a sealed value cannot be replayed
under another key (another round, another incarnation). A reader opens a value with the same
secret; a value that is unsealed, sealed with another secret, or altered is treated as absent
and logged (once per key family), never acted on.

The secret comes from ``LIGHTNING_FT_SECRET_FILE`` (a file only this user can read; its
content is the secret) or ``LIGHTNING_FT_SECRET``; every participant of a job, and
``lightning-ft store``, must have the same one. Without a secret values are written and read
unsealed, with one warning per process: the job runs, but a client that reaches the store
can steer it (end it, stop it, fail it). It still never executes what it reads (snapshot data
is decoded with a restricted loader either way), and no snapshot is taken from the store
without a secret (replicas for hot spares need one; they are also encrypted with a key derived
from it, :mod:`.encryption`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lightning_ft.deadlines import StoreClient
from lightning_ft.settings.environment import environ

log = logging.getLogger(__name__)

ENV_SECRET = "LIGHTNING_FT_SECRET"
ENV_SECRET_FILE = "LIGHTNING_FT_SECRET_FILE"

MAGIC = b"LFTs"
TAG_BYTES = 16


#: how often a writer re-tries to replace values that keep failing their check before it gives up
_REPLACE_ATTEMPTS = 64
_CACHE_LIMIT = 200_000


class StoreTamperedError(RuntimeError):
    """A store value this process must move on kept being replaced by values that fail their check."""


class SecretError(ValueError):
    """The job secret is configured but unusable; the message says why."""


class SealError(ValueError):
    """A value is not authentic (unsealed, sealed with another secret, or altered); the message says why."""


class Signer:
    """Seals and opens store values with one job secret (or passes them through without one)."""

    def __init__(self, secret: bytes | None, source: str = "") -> None:
        self._secret = secret or None
        self.source = source
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def derived_key(self, label: bytes, length: int = 32) -> bytes | None:
        """A key for another use of the job secret (HKDF-SHA256, ``label`` as its info): never
        the secret itself, and another label gives an unrelated key. None without a secret."""
        if self._secret is None:
            return None
        return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=label).derive(self._secret)

    def _tag(self, key: str, value: bytes) -> bytes:
        assert self._secret is not None  # callers seal and open with a secret only
        mac = hmac.new(self._secret, key.encode() + b"\0", hashlib.sha256)
        mac.update(value)
        return mac.digest()[:TAG_BYTES]

    def seal(self, key: str, value: bytes | str) -> bytes:
        """The bytes to store under ``key`` for ``value``."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        if self._secret is None:
            return data
        return MAGIC + self._tag(key, data) + data

    def open(self, key: str, raw: bytes | None) -> bytes | None:
        """The value stored under ``key``, or None when it is missing or not authentic (logged once
        per kind of key)."""
        if raw is None:
            return None
        try:
            return self.unseal(key, raw)
        except SealError as exc:
            self._reject(key, str(exc))
            return None

    def unseal(self, key: str, raw: bytes) -> bytes:
        """The value sealed under ``key`` in ``raw``; SealError saying why when it is not authentic."""
        raw = bytes(raw)
        if self._secret is None:
            if raw.startswith(MAGIC):
                raise SealError("it is sealed, but this process has no job secret "
                                f"({ENV_SECRET_FILE} or {ENV_SECRET} differs between participants)")
            return raw
        if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + TAG_BYTES:
            raise SealError("it is not sealed with the job secret")
        tag, data = raw[len(MAGIC):len(MAGIC) + TAG_BYTES], raw[len(MAGIC) + TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(key, data)):
            raise SealError("its seal does not match the job secret (forged, altered, or another job's)")
        return data

    def rejected(self) -> list[str]:
        """The kinds of store keys (see :func:`_family`) whose values failed their check so far."""
        with self._lock:
            return sorted(self._warned)

    def invalid_values_note(self) -> str:
        """`` (store values that failed their check: ...)`` for an error message, or ``""``."""
        families = self.rejected()
        return f" (store values that failed their check: {', '.join(families)})" if families else ""

    def _reject(self, key: str, why: str) -> None:
        family = _family(key)
        with self._lock:
            if family in self._warned:
                return
            self._warned.add(family)
        log.warning("ignored the value of store key %s (and will ignore such values of %s... silently): %s",
                    key, family, why)


def _family(key: str) -> str:
    """``lightning_ft/job/i0/r3/job/member/1`` -> ``lightning_ft/job/job/member``: one warning per kind of key."""
    return "/".join(p for p in key.split("/") if not p.isdigit() and not (p[:1] in "ri" and p[1:].isdigit()))


def read_secret(env: Mapping[str, str] | None = None) -> tuple[bytes | None, str]:
    """The job secret and where it came from; ``(None, "")`` when none is configured.

    A secret file must be a regular file of this user that others cannot read (it is a
    credential); else SecretError. An empty secret is an error, not "no secret".
    """
    env = environ() if env is None else env
    path = env.get(ENV_SECRET_FILE, "").strip()
    if path:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise SecretError(f"{ENV_SECRET_FILE}={path!r}: cannot open it: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SecretError(f"{ENV_SECRET_FILE}={path!r} is not a regular file")
            if st.st_uid != os.getuid():
                raise SecretError(f"{ENV_SECRET_FILE}={path!r} belongs to uid {st.st_uid}, not to this user")
            if st.st_mode & 0o077:
                raise SecretError(f"{ENV_SECRET_FILE}={path!r} is readable by others (mode "
                                  f"{stat.S_IMODE(st.st_mode):o}); chmod 600 it")
            secret = os.read(fd, 1 << 16).strip()
        finally:
            os.close(fd)
        if not secret:
            raise SecretError(f"{ENV_SECRET_FILE}={path!r} is empty")
        return secret, f"{ENV_SECRET_FILE}={path}"
    value = env.get(ENV_SECRET)
    if value is not None:
        if not value.strip():
            raise SecretError(f"{ENV_SECRET} is set but empty")
        return value.strip().encode(), ENV_SECRET
    return None, ""


@lru_cache(maxsize=1)
def job_signer() -> Signer:
    """This process's signer, from the environment (read once); warns once when there is no secret."""
    secret, source = read_secret()
    if secret is None:
        log.warning("no job secret (%s or %s): every client of the store is trusted as a member of this job, as "
                    "with torchrun's store -- it can join it, steer its weights, stop or end it; it cannot make a "
                    "process run code, resume another job's state or make a healthy node leave (docs/trust.md). "
                    "To authenticate the job: umask 077; python3 -c 'import secrets; "
                    "print(secrets.token_hex(32))' > ~/.lightning_ft_secret and export "
                    "%s=~/.lightning_ft_secret on every node (a filesystem they all see).",
                    ENV_SECRET_FILE, ENV_SECRET, ENV_SECRET_FILE)
    return Signer(secret, source)


#: What ``compare_set`` answers for a key that is not there when told to expect these bytes
#: (no value we write is ever these bytes; a forged one reads as absent).
ABSENT = b"\x00lightning_ft:absent"


def get_if_present(store: StoreClient, key: str) -> bytes | None:
    """The raw value of ``key``, or None when it is not there: one request where ``check`` then
    ``get`` are two, and never blocking (torch's ``get`` waits for a missing key). It is a
    ``compare_set`` that expects :data:`ABSENT`, which writes nothing: for a missing key torch
    answers the expected bytes, for a present one its value."""
    raw = bytes(store.compare_set(key, ABSENT, ABSENT))
    return None if raw == ABSENT else raw


class SealedStore:
    """The sealed values of one key space of a ``torch.distributed`` Store.

    Keys are given relative to ``prefix``; the MAC covers the full key. Counters (``add``) and
    torch's own keys are not values and stay on the raw store.
    """

    def __init__(self, store: StoreClient, signer: Signer, prefix: str = "") -> None:
        self.store = store
        self.signer = signer
        self.prefix = prefix

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def unlisted(self, name: str) -> str:
        """``name`` with a suffix only holders of the secret can compute (``name`` without one).

        For a value whose mere overwriting would hurt (a sealed ``closed_for_good`` that a forger
        kept overwriting left the store server waiting for the run to close): a client without
        the secret cannot compute the name. Defence in depth only: torch's ``TCPStore.list_keys``
        finds it, so readers also treat an overwritten value as tampering, never as an answer.
        """
        if not self.signer.enabled:
            return name
        return f"{name}.{self.signer._tag('unlisted:' + self.key(name), b'').hex()}"

    def put(self, name: str, value: bytes | str) -> None:
        key = self.key(name)
        self.store.set(key, self.signer.seal(key, value))

    def get(self, name: str) -> bytes | None:
        """The authentic value of ``name``, or None (absent or not authentic); never blocks."""
        key = self.key(name)
        raw = get_if_present(self.store, key)
        return None if raw is None else self.signer.open(key, raw)

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    def multi_get(self, names: list[str]) -> list[bytes | None]:
        """Authentic values of ``names`` that all exist (``multi_get`` waits for missing keys)."""
        keys = [self.key(n) for n in names]
        if not keys:
            return []
        return [self.signer.open(k, raw) for k, raw in zip(keys, self.store.multi_get(keys), strict=True)]

    def multi_get_if_all_present(self, names: list[str]) -> list[bytes | None] | None:
        """:meth:`multi_get` when every one of ``names`` exists (two requests), else None; never
        blocks (values are never deleted, so what ``check`` found is still there)."""
        if names and not self.store.check([self.key(n) for n in names]):
            return None
        return self.multi_get(names)

    def multi_put(self, names: list[str], values: Sequence[bytes | str]) -> None:
        keys = [self.key(n) for n in names]
        self.store.multi_set(keys, [self.signer.seal(k, v) for k, v in zip(keys, values, strict=True)])

    def put_if_absent(self, name: str, value: bytes | str) -> bytes:
        """Store ``value`` unless an authentic one is there; returns the authentic value in force.

        A value that is there but not authentic (forged, garbled) is replaced with ``compare_set``
        on exactly those bytes, so writers racing over it agree on the first authentic value.
        """
        key = self.key(name)
        sealed = self.signer.seal(key, value)
        expected: bytes | str = ""
        for _ in range(_REPLACE_ATTEMPTS):
            current = bytes(self.store.compare_set(key, expected, sealed))
            opened = self.signer.open(key, current)
            if opened is not None:
                return opened
            expected = current  # not authentic: replace exactly what is there
        raise StoreTamperedError(f"store key {key} kept changing to values that fail their check "
                                 f"({_REPLACE_ATTEMPTS} attempts to replace them)")

    def replace(self, name: str, keep: Callable[[bytes], bool], value: bytes | str) -> bytes:
        """Set ``value`` unless the authentic value there satisfies ``keep``; returns the value in force.

        Atomic against concurrent writers (``compare_set`` on exactly the bytes read); a missing
        or inauthentic value is replaced.
        """
        key = self.key(name)
        data = value.encode() if isinstance(value, str) else bytes(value)
        sealed = self.signer.seal(key, data)
        current = bytes(self.store.get(key)) if self.store.check([key]) else b""
        for _ in range(_REPLACE_ATTEMPTS):
            opened = self.signer.open(key, current) if current else None
            if opened is not None and keep(opened):
                return opened
            moved = bytes(self.store.compare_set(key, current, sealed))
            if moved == sealed:
                return data
            current = moved
        raise StoreTamperedError(f"store key {key} kept changing ({_REPLACE_ATTEMPTS} attempts to move it on)")

    def append(self, name: str, record: bytes | str) -> None:
        """Append one sealed record to the log ``name`` (torch's atomic ``append``).

        A record is framed as a base64 line with a newline on both sides: whatever a store
        client appends in between (no newline, a partial line) ends at our leading newline
        and cannot swallow a record of ours.
        """
        key = self.key(name)
        self.store.append(key, b"\n" + base64.b64encode(self.signer.seal(key, record)) + b"\n")

    def records(self, name: str, cache: dict[bytes, bytes | None] | None = None) -> list[bytes]:
        """The authentic records of the log ``name``, in the order they were appended.

        Lines that are not ours (not base64, not sealed, sealed for another key) are skipped
        and logged once per kind of key. Records are not deduplicated: a replayed line is read
        twice, so records carry what a reader needs to tell (see the record encoders).
        ``cache`` maps lines already opened to their record, for readers that re-read a log.
        """
        key = self.key(name)
        if not self.store.check([key]):
            return []
        out = []
        for line in bytes(self.store.get(key)).split(b"\n"):
            if not line:
                continue
            if cache is not None and line in cache:
                opened = cache[line]
            else:
                try:
                    raw: bytes | None = base64.b64decode(line, validate=True)
                except (binascii.Error, ValueError):
                    self.signer._reject(key, "a line of this log is not a record of ours")
                    raw = None
                opened = self.signer.open(key, raw) if raw is not None else None
                if cache is not None and len(cache) < _CACHE_LIMIT:
                    cache[line] = opened
            if opened is not None:
                out.append(opened)
        return out

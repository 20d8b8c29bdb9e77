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

import hashlib
import hmac
import logging
import os
import stat
import threading
from functools import lru_cache
from typing import Mapping

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from lightning_ft.settings.environment import environ

log = logging.getLogger(__name__)

ENV_SECRET = "LIGHTNING_FT_SECRET"
ENV_SECRET_FILE = "LIGHTNING_FT_SECRET_FILE"

MAGIC = b"LFTs"
TAG_BYTES = 16


class SecretError(ValueError):
    """The job secret is configured but unusable; the message says why."""


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
        mac = hmac.new(self._secret, key.encode() + b"\0", hashlib.sha256)  # type: ignore[arg-type]
        mac.update(value)
        return mac.digest()[:TAG_BYTES]

    def seal(self, key: str, value: bytes | str) -> bytes:
        """The bytes to store under ``key`` for ``value``."""
        data = value.encode() if isinstance(value, str) else bytes(value)
        if self._secret is None:
            return data
        return MAGIC + self._tag(key, data) + data

    def open(self, key: str, raw: bytes | None) -> bytes | None:
        """The value stored under ``key``, or None when it is missing or not authentic."""
        if raw is None:
            return None
        raw = bytes(raw)
        if self._secret is None:
            if raw.startswith(MAGIC):
                self._reject(key, "it is sealed, but this process has no job secret "
                                  f"({ENV_SECRET_FILE} or {ENV_SECRET} differs between participants)")
                return None
            return raw
        if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + TAG_BYTES:
            self._reject(key, "it is not sealed with the job secret")
            return None
        tag, data = raw[len(MAGIC):len(MAGIC) + TAG_BYTES], raw[len(MAGIC) + TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(key, data)):
            self._reject(key, "its seal does not match the job secret (forged, altered, or another job's)")
            return None
        return data

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
        log.warning("no job secret (%s or %s): control-plane values in the store are not authenticated; anyone "
                    "who can reach the store can end, stop or fail this job. No snapshot is taken from the store "
                    "(no replicas on hot spares: a spare starts from the survivors' snapshots). See docs/trust.md.",
                    ENV_SECRET_FILE, ENV_SECRET)
    return Signer(secret, source)


class SealedStore:
    """The sealed values of one key space of a ``torch.distributed`` Store.

    Keys are given relative to ``prefix``; the MAC covers the full key. Counters (``add``) and
    torch's own keys are not values and stay on the raw store.
    """

    def __init__(self, store, signer: Signer, prefix: str = "") -> None:
        self.store = store
        self.signer = signer
        self.prefix = prefix

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def unlisted(self, name: str) -> str:
        """``name`` with a suffix only holders of the secret can compute (``name`` without one).

        For a value whose mere overwriting would hurt: a store client cannot list keys, so
        without the secret it cannot find this one to overwrite or delete it (a sealed
        ``closed_for_good`` that a forger kept overwriting left the store server waiting for
        the run to close).
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
        if not self.store.check([key]):
            return None
        return self.signer.open(key, self.store.get(key))

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    def multi_get(self, names: list[str]) -> list[bytes | None]:
        """Authentic values of ``names`` that all exist (``multi_get`` waits for missing keys)."""
        keys = [self.key(n) for n in names]
        return [self.signer.open(k, raw) for k, raw in zip(keys, self.store.multi_get(keys))] if keys else []

    def multi_put(self, names: list[str], values: list[bytes | str]) -> None:
        keys = [self.key(n) for n in names]
        self.store.multi_set(keys, [self.signer.seal(k, v) for k, v in zip(keys, values)])

    def put_if_absent(self, name: str, value: bytes | str) -> bytes:
        """Store ``value`` unless an authentic one is there; returns the authentic value in force.

        A value that is there but not authentic (forged) is overwritten; writers racing over a
        forged value then agree on whichever authentic value the store holds last.
        """
        key = self.key(name)
        sealed = self.signer.seal(key, value)
        opened = self.signer.open(key, self.store.compare_set(key, "", sealed))
        if opened is not None:
            return opened
        self.store.set(key, sealed)
        final = self.signer.open(key, self.store.get(key))
        return final if final is not None else self.signer.open(key, sealed)

"""Store values only the job can read: snapshot replicas encrypted with a key from the job secret.

Sealing (:mod:`.signing`) proves that a value comes from the job, but leaves it readable, and a
client that reaches the store can list and read every key (``TCPStore.list_keys``), as can
anyone who sees the store's plain TCP traffic. A snapshot replica holds the model and the
optimizer state, so its bytes are encrypted as well as authenticated: AES-256-GCM with a key
derived from the job secret (HKDF-SHA256, info :data:`REPLICA_KEY_LABEL`, so it is never the
key the seals use), a fresh random 96-bit nonce per stored value, and, as associated data, the
full store key the value lives under (run id, incarnation, round, step and chunk index are all
in it) with the chunk's index, the number of chunks and the snapshot's size. A value opened
under another key, in another position or as part of another snapshot fails its tag, as does
any altered byte.

A replica is stored in chunks of at most ``REPLICA_CHUNK_BYTES`` (:mod:`.round`): each is one
store value, so neither the store server nor a reader ever handles one value of the snapshot's
whole size, and random nonces stay far below AES-GCM's limit of 2**32 messages per key.
Pure functions of their arguments: no I/O.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lightning_ft.schema.signing import Signer

#: HKDF info of the replica key: another use of the job secret gets another label
REPLICA_KEY_LABEL = b"lightning_ft replica v1"
NONCE_BYTES = 12
TAG_BYTES = 16
#: what a sealed chunk adds to its plaintext (nonce in front, tag at the end)
SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES
_POSITION = struct.Struct("<QQQ")  # chunk index, number of chunks, snapshot bytes


def chunk_spans(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each chunk of ``total`` bytes cut into pieces of ``chunk_bytes``
    (the last may be shorter; one empty chunk for an empty value)."""
    if total <= 0:
        return [(0, 0)]
    return [(offset, min(chunk_bytes, total - offset)) for offset in range(0, total, chunk_bytes)]


def _associated_data(store_key: str, index: int, count: int, total: int) -> bytes:
    return REPLICA_KEY_LABEL + b"\0" + store_key.encode() + b"\0" + _POSITION.pack(index, count, total)


class ReplicaCipher:
    """Encrypts and opens the chunks of snapshot replicas with the job's replica key."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @classmethod
    def for_job(cls, signer: Signer) -> ReplicaCipher | None:
        """The cipher of ``signer``'s job secret; None when the job has no secret."""
        key = signer.derived_key(REPLICA_KEY_LABEL)
        return None if key is None else cls(key)

    def seal(self, store_key: str, index: int, count: int, total: int, data: bytes | memoryview) -> bytes:
        """The stored value for chunk ``index`` of ``count`` of a ``total``-byte snapshot under ``store_key``."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, _associated_data(store_key, index, count, total))

    def open(self, store_key: str, index: int, count: int, total: int, sealed: bytes | memoryview) -> bytes | None:
        """The plaintext of a value :meth:`seal` wrote with the same arguments; None when it was not
        (another key, position or snapshot, altered, or sealed with another secret)."""
        view = memoryview(sealed)
        if len(view) < SEAL_OVERHEAD:
            return None
        try:
            return self._aead.decrypt(view[:NONCE_BYTES], view[NONCE_BYTES:],
                                      _associated_data(store_key, index, count, total))
        except InvalidTag:
            return None

    def seal_chunks(self, store_keys: list[str], blob: bytes | memoryview,
                    chunk_bytes: int) -> Iterator[tuple[str, bytes]]:
        """``(store key, sealed value)`` of each chunk of ``blob``; ``store_keys`` names one per chunk."""
        view = memoryview(blob)
        spans = chunk_spans(len(view), chunk_bytes)
        if len(store_keys) != len(spans):
            raise ValueError(f"{len(spans)} chunks need as many store keys, not {len(store_keys)}")
        for index, (key, (offset, length)) in enumerate(zip(store_keys, spans, strict=True)):
            yield key, self.seal(key, index, len(spans), len(view), view[offset: offset + length])

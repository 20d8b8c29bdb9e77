"""What encrypting snapshot replicas costs: seal + open per GiB, against a memory copy and the
HMAC-only sealing replicas had before (issue 24, finding 3).

One real snapshot file (a float32 state of ``--mib`` MiB, written by ``SnapshotStore`` in
/dev/shm) is published and taken back the way rank 0 and a hot spare do it -- ``put_replica``
(AES-256-GCM in 16 MiB chunks, each a store value) and ``fetch_replica`` (open, check the
header, assemble) -- through an in-memory store, so the network is not measured. Anchors,
measured in the same run on the same bytes:

* ``copy``: one memory copy of the snapshot (into a preallocated buffer);
* ``hmac``: what a replica cost before: ``Signer.seal`` (HMAC-SHA256 over the snapshot, a copy
  with the tag in front) and ``Signer.open`` (the HMAC again, a copy without it).

Prints the median seconds per GiB of each (``--repeats`` alternating rounds) and the ratios.

    python benchmarks/bench_replica_crypto.py [--mib 256,1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from lightning_ft.checkpoint.exchange.replication import fetch_replica, put_replica, read_snapshot_file
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.schema.encryption import ReplicaCipher
from lightning_ft.schema.round import REPLICA_CHUNK_BYTES, ReplicaMeta
from lightning_ft.schema.signing import SealedStore, Signer

PREFIX = "lightning_ft/bench/i0/r0/job"
GIB = 1 << 30


class MemoryStore:
    """The Store calls a replica makes, on a dict (no network)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: bytes | str) -> None:
        self.values[key] = value.encode() if isinstance(value, str) else value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.values.get(key, expected)


def snapshot_blob(mib: int, root: str) -> bytes:
    store = SnapshotStore(root, run_id="bench", rank=0)
    state = {"state_dict": {"w": torch.randn(mib << 18)}}  # mib MiB of float32
    return read_snapshot_file(store.save(state, step=1).path)


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def measure(blob: bytes, repeats: int) -> dict[str, list[float]]:
    """Seconds per round of each way, ``repeats`` alternating rounds."""
    signer = Signer(b"bench-secret-" + os.urandom(16).hex().encode())
    cipher = ReplicaCipher.for_job(signer)
    identity = fmt.read_identity(blob, fmt.Header.unpack(blob))
    meta = ReplicaMeta(1, ("host-a",), identity.run_id, identity.model, len(blob), REPLICA_CHUNK_BYTES)
    target = bytearray(len(blob))
    key = f"{PREFIX}/replica/blob"

    def copy() -> None:
        target[:] = blob

    def hmac_only() -> None:
        signer.open(key, signer.seal(key, blob))

    checked = SealedStore(MemoryStore(), signer, PREFIX)  # warm up, and check the round trip once
    put_replica(checked, cipher, meta, blob)
    assert fetch_replica(checked, cipher, meta) == blob and signer.open(key, signer.seal(key, blob)) == blob
    del checked
    seconds: dict[str, list[float]] = {"copy": [], "hmac": [], "aead": []}
    for _ in range(repeats):
        seconds["copy"].append(timed(copy))
        seconds["hmac"].append(timed(hmac_only))
        values = SealedStore(MemoryStore(), signer, PREFIX)
        seal = timed(functools.partial(put_replica, values, cipher, meta, blob))
        seconds["aead"].append(seal + timed(functools.partial(fetch_replica, values, cipher, meta)))
        del values
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="256,1024", help="snapshot sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{'MiB':>6} {'copy s/GiB':>11} {'hmac s/GiB':>11} {'aead s/GiB':>11} {'aead/copy':>10} {'aead/hmac':>10}")
    for mib in (int(m) for m in args.mib.split(",")):
        root = tempfile.mkdtemp(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None, prefix="bench-replica-")
        try:
            blob = snapshot_blob(mib, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        per_gib = {name: statistics.median(s) * GIB / len(blob) for name, s in measure(blob, args.repeats).items()}
        print(f"{mib:>6} {per_gib['copy']:>11.3f} {per_gib['hmac']:>11.3f} {per_gib['aead']:>11.3f} "
              f"{per_gib['aead'] / per_gib['copy']:>10.1f} {per_gib['aead'] / per_gib['hmac']:>10.2f}")
        del blob


if __name__ == "__main__":
    main()

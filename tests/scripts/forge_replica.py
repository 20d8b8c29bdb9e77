"""An attacker that reaches a job's store and plants snapshot replicas for its hot spares.

Two attacks of issue 24 (``tests/test_replica_trust.py``):

``--reweight DIR`` (a job without a secret): take the newest snapshot in ``DIR`` (the job's
own state, as a store client read it from a replica before replicas were encrypted), set every
weight to 42.0, re-encode it at step 10000+ and plant it, unsealed, as the round's replica.

``--foreign`` (with the job secret in the environment: a client that holds it, such as another
job of the same user or a participant of another model): plant, sealed and encrypted as the job
would, replicas at step 100000 announcing another model, an absurd size, and a 4 KiB copy
whose header claims 1 GiB of data.

Prints ``planted <kind>`` after each value it writes; runs until killed or ``--seconds`` pass.

    python forge_replica.py --endpoint HOST:PORT --run-id RUN (--reweight DIR | --foreign)
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import tempfile
import time

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.exchange.replication import put_replica
from lightning_ft.checkpoint.identity import state_dict_fingerprint
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.checkpoint.memory.files import read_snapshot_bytes
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.schema.encryption import ReplicaCipher
from lightning_ft.schema.round import (
    REPLICA_META_KEY,
    ReplicaMeta,
    encode_replica_meta,
    replica_chunk_key,
)
from lightning_ft.schema.run import RunKeys
from lightning_ft.schema.signing import SealedStore, job_signer

FOREIGN_STEP = 100_000


def reweighted(template_dir: str, run_id: str, step: int, scratch: str) -> bytes | None:
    """The newest snapshot in ``template_dir`` with every floating weight 42.0, as step ``step``."""
    paths = sorted(glob.glob(os.path.join(template_dir, "step-*.snap")))
    for path in reversed(paths):
        try:
            blob = read_snapshot_bytes(path)
            state = fmt.decode(blob, fmt.verify(blob, len(blob)))
        except (OSError, fmt.SnapshotError):
            continue  # recycled while we read it: take the one before
        for tensor in state["state_dict"].values():
            if tensor.is_floating_point():
                tensor.fill_(42.0)
        forged = SnapshotStore(root=scratch, run_id=run_id, rank=0)
        return forged.read_bytes(forged.save(state, step=step))
    return None


def foreign_model_snapshot(run_id: str, scratch: str) -> bytes:
    """A valid snapshot of this run id, of a model with other parameters (about 4 KiB)."""
    store = SnapshotStore(root=scratch, run_id=run_id, rank=0)
    return store.read_bytes(store.save({"state_dict": {"other.weight": torch.zeros(8)}}, step=FOREIGN_STEP))


def header_claiming_a_gib(run_id: str, model: str) -> bytes:
    """4 KiB: a consistent header and identity record of a snapshot with 1 GiB of data, and nothing else."""
    identity = fmt.encode_identity(run_id, 0, model)
    data_len, nblocks = 1 << 30, (1 << 30) // fmt.BLOCK_SIZE
    meta_off = fmt._align(fmt.HEADER_SIZE + len(identity), 8) + 8 * nblocks
    data_off = fmt._align(meta_off + 64, fmt.PAGE)
    header = fmt.Header(FOREIGN_STEP, time.time(), data_off + data_len, len(identity), meta_off, 64, data_off,
                        data_len, fmt.BLOCK_SIZE, nblocks, 0)
    return (header.pack() + identity).ljust(4096, b"\0")


def job_model(hidden: int = 32) -> str:
    """The fingerprint of ft_train.py's model, which an attacker who knows the architecture computes."""
    return state_dict_fingerprint({"net.0.weight": torch.zeros(hidden, 16), "net.0.bias": torch.zeros(hidden),
                                   "net.2.weight": torch.zeros(1, hidden), "net.2.bias": torch.zeros(1)})


def plant_foreign(values: SealedStore, cipher: ReplicaCipher, run_id: str, scratch: str) -> list[str]:
    """The three foreign replicas, one after the other: what each was."""
    other = foreign_model_snapshot(run_id, scratch)
    other_model = fmt.read_identity(other, fmt.Header.unpack(other)).model
    put_replica(values, cipher, ReplicaMeta(FOREIGN_STEP, ("forged-domain",), run_id, other_model, len(other),
                                            4096), other)
    yield "another-model"
    huge = ReplicaMeta(FOREIGN_STEP, ("forged-domain",), run_id, job_model(), 1 << 40, 4096)
    values.put(REPLICA_META_KEY, encode_replica_meta(huge))  # no chunks: a spare that reads any would wait
    yield "huge"
    lying = header_claiming_a_gib(run_id, job_model())
    put_replica(values, cipher, ReplicaMeta(FOREIGN_STEP, ("forged-domain",), run_id, job_model(), len(lying),
                                            4096), lying)
    yield "lying-header"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--reweight", metavar="DIR", help="re-weight the newest snapshot in DIR and plant it")
    parser.add_argument("--foreign", action="store_true", help="plant foreign replicas sealed with the job secret")
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    host, _, port = args.endpoint.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    signer = job_signer()
    cipher = ReplicaCipher.for_job(signer)
    if args.foreign and cipher is None:
        parser.error("--foreign needs the job secret (LIGHTNING_FT_SECRET_FILE or LIGHTNING_FT_SECRET)")
    keys = RunKeys(args.run_id, 0)
    deadline = time.monotonic() + args.seconds
    forged = 0
    with tempfile.TemporaryDirectory() as scratch:
        while time.monotonic() < deadline:
            try:
                round_id = RunRecords(store, signer, keys).current_round()  # sealed when the forger has the secret
                values = SealedStore(store, signer, keys.round_store_prefix(round_id))
                if args.foreign:
                    for kind in plant_foreign(values, cipher, args.run_id, scratch):
                        print(f"planted {kind}", flush=True)
                        time.sleep(0.5)  # a spare polls every 0.25 s: let it see each one
                else:
                    step = 10_000 + forged
                    blob = reweighted(args.reweight, args.run_id, step, os.path.join(scratch, str(step)))
                    if blob is not None:
                        identity = fmt.read_identity(blob, fmt.Header.unpack(blob))
                        store.set(f"{values.prefix}/{replica_chunk_key(step, 0)}", blob)
                        values.put(REPLICA_META_KEY, encode_replica_meta(ReplicaMeta(
                            step, ("forged-domain",), args.run_id, identity.model, len(blob), len(blob))))
                        forged += 1
                        print(f"planted reweighted step {step}", flush=True)
                    time.sleep(0.2)
            except (RuntimeError, OSError):  # torch's DistNetworkError: the job ended, its store with it
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

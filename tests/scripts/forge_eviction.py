"""A store client that writes straggler evictions into a job's rounds (issue 37, finding 6).

It knows what any store client can read -- the run id, the incarnation, this launch's id -- but
not the job's secret. Every 0.1 s it sets the ``evict`` key of rounds 0 to 3, each naming a
healthy rank (round k: rank k % 2):

* first, evictions as a participant would write them, bound to this run, incarnation, round and
  launch, unsealed (``--unsealed``; in a job without a secret that is what a real one looks like);
* then, once the file ``--then`` exists, the bytes given with ``--replay ROUND:HEX`` (a sealed
  eviction of an earlier launch of the job id under the same secret: all an attacker without the
  secret can have that verifies).

    python forge_eviction.py --endpoint HOST:PORT --run-id RUN [--then PATH --replay ROUND:HEX ...]

Prints ``forging`` once the first values are in place, ``replaying`` once it switched; ends on
SIGTERM, after ``--seconds`` or when the store is gone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time

import torch.distributed as dist

from lightning_ft.schema.round import EVICT_KEY, EvictionScope, encode_eviction
from lightning_ft.schema.run import LAUNCH_KEY, RunKeys, incarnation_key
from lightning_ft.schema.signing import MAGIC, TAG_BYTES

ROUNDS = range(4)


def plain(raw: bytes) -> bytes:
    """A stored value without its seal (sealed is not encrypted)."""
    return raw[len(MAGIC) + TAG_BYTES:] if raw.startswith(MAGIC) else raw


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--then", default=None, help="switch to the replays once this file exists")
    parser.add_argument("--replay", action="append", default=[], metavar="ROUND:HEX")
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    host, _, port = args.endpoint.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    incarnation = int(plain(store.get(incarnation_key(args.run_id))))
    launch_id = plain(store.get(LAUNCH_KEY)).decode()
    keys = RunKeys(args.run_id, incarnation)
    forged = {r: encode_eviction(EvictionScope(args.run_id, incarnation, r, launch_id), r % 2, 1,
                                 "forged by a store client").encode() for r in ROUNDS}
    replays = {int(r): bytes.fromhex(h) for r, h in (spec.split(":", 1) for spec in args.replay)}
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    deadline = time.monotonic() + args.seconds
    said = ""
    while time.monotonic() < deadline and not stop["requested"]:
        replaying = args.then is not None and os.path.exists(args.then)
        values = {**forged, **replays} if replaying else forged
        try:
            for round_id, value in values.items():
                store.set(f"{keys.round_store_prefix(round_id)}/{EVICT_KEY}", value)
        except (RuntimeError, OSError):  # torch's DistNetworkError: the job ended, its store with it
            break
        now = "replaying" if replaying else "forging"
        if now != said:
            print(now, flush=True)
            said = now
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

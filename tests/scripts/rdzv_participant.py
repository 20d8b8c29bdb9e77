"""One participant of a barrier rendezvous in a process of its own, for fault tests.

Joins round 0 of ``--run-id`` at ``--endpoint`` and prints ``RESULT rank=R world=W``.
``--die-deciding``: this process is SIGKILLed by itself right after, as coordinator, it wrote
its rank answers for the round and before it marked the round ready -- the window in which a
lost coordinator used to leave everyone waiting for join_timeout.

    python rdzv_participant.py --endpoint HOST:PORT --run-id RUN --name NAME [--die-deciding]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import time

import torch.distributed as dist

from lightning_ft.rendezvous import BarrierRendezvous, ParticipantInfo, RendezvousSettings
from lightning_ft.schema.signing import SealedStore


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--nodes", default="2:3")
    parser.add_argument("--join-timeout", type=float, default=60.0)
    parser.add_argument("--die-deciding", action="store_true")
    args = parser.parse_args()
    if args.die_deciding:
        multi_put = SealedStore.multi_put

        def die_after(self, names, values):
            multi_put(self, names, values)
            if any("/decision/" in n or n.endswith("/rank") for n in names):
                print("dying while deciding", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        SealedStore.multi_put = die_after
    host, _, port = args.endpoint.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    low, high = (int(x) for x in args.nodes.split(":"))
    settings = RendezvousSettings.of(run_id=args.run_id, min_nodes=low, max_nodes=high, join_timeout=args.join_timeout,
                                     last_call_timeout=0.3, heartbeat_interval=0.1)
    info = ParticipantInfo(addr=args.name, pid=os.getpid(), local_id=0, infra_rank=-1, domain_id=args.name)
    rendezvous = BarrierRendezvous(store, settings, info)
    start = time.monotonic()
    result = rendezvous.join_round()
    print(f"RESULT rank={result.rank} world={result.world_size} seconds={time.monotonic() - start:.2f}", flush=True)
    rendezvous.stop_heartbeat()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

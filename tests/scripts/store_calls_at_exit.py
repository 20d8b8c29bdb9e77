"""A process whose threads are inside store calls when it ends (``tests/test_store_calls_at_exit.py``).

Daemon threads use :class:`~lightning_ft.deadlines.BoundedStore` clients of the store at
``--port`` as a hot spare's heartbeat and monitor do:

* ``beater-N`` set a key again and again and are never stopped: at almost any moment one of
  their workers is inside ``TCPStore.set``;
* ``waiter`` waits for ``--key``, which the test sets only once this process printed
  ``main done``: its call is in flight when the main thread ends.

The main thread then returns (exit 0). An object that only finalization frees keeps it going
until ``--key`` exists, and a moment longer, so that an answer which comes back to a thread
during finalization does so while the process still runs: on Python < 3.14 that aborts it
("terminate called without an active exception", SIGABRT).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
import types

import torch.distributed as dist

from lightning_ft.deadlines import BoundedStore

#: how long a call of this script waits for the store; the test answers well within it
BOUND_S = 60.0
#: threads that set a key without pause: at the end, one of them is inside a call almost surely
BEATERS = 4
#: what they set: large enough that each call spends most of its time in C++, not in Python
VALUE = bytes(1 << 20)
#: after the key exists, finalization goes on this long: time for a thread to come back
LINGER_S = 1.0


class _Finalization:
    """Its ``__del__`` runs while the interpreter finalizes (see ``main``); it holds what it uses,
    as module globals may already be cleared then."""

    def __init__(self, probe: dist.TCPStore, key: str) -> None:
        self.probe, self.key = probe, key
        self.clock, self.sleep, self.write = time.monotonic, time.sleep, os.write
        self.bound, self.linger = BOUND_S, LINGER_S

    def __del__(self) -> None:
        deadline = self.clock() + self.bound
        while not self.probe.check([self.key]) and self.clock() < deadline:
            self.sleep(0.01)
        self.sleep(self.linger)
        self.write(1, b"finalized\n")  # sys.stdout may be gone by now


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args()

    def connect() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=BOUND_S))

    beats = threading.Semaphore(0)

    def beat(store: BoundedStore) -> None:
        while True:
            try:
                store.set("beat", VALUE)
            except Exception as exc:  # noqa: BLE001 - reported, as the heartbeat stops quietly
                print(f"beater: {type(exc).__name__}", flush=True)
                return
            beats.release()

    def wait(store: BoundedStore) -> None:
        store.wait([args.key])

    for n in range(BEATERS):
        threading.Thread(target=beat, args=(BoundedStore(connect(), BOUND_S),), name=f"beater-{n}",
                         daemon=True).start()
    threading.Thread(target=wait, args=(BoundedStore(connect(), BOUND_S),), name="waiter", daemon=True).start()
    # kept by a module of its own: its ``__del__`` runs when finalization clears the modules,
    # however this script was started (a forked test process runs it from a temporary module)
    holder = types.ModuleType("_store_calls_at_exit_finalization")
    holder.finalization = _Finalization(connect(), args.key)  # type: ignore[attr-defined]
    sys.modules[holder.__name__] = holder
    for _ in range(20 * BEATERS):  # the beaters are in full swing
        beats.acquire(timeout=BOUND_S)
    print("main done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

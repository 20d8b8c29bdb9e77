"""``lightning-ft store``: a standalone TCPStore for the rendezvous.

Hosting the store in its own process (for example on the login node, or as a small
pod) means losing any training node never loses the store. With ``--run-id`` the server
exits by itself once that run is closed for good and its participants acknowledged
(bounded by ``--grace-timeout``), then served ``--linger`` seconds more; otherwise it serves
until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

from lightning_ft._clock import monotonic
from lightning_ft._logging import ensure_log_output
from lightning_ft.rendezvous.lifecycle import wait_for_acknowledgements
from lightning_ft.rendezvous.records import RunRecords, current_incarnation, publish_launch_id
from lightning_ft.schema.run import CloseReason, RunKeys
from lightning_ft.schema.signing import SealedStore, SecretError, job_signer
from lightning_ft.store.tcp import host_store

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-ft store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", required=True,
                        help="address to listen on, and only there: this node's address on the job's network, "
                             "127.0.0.1 for one machine, 0.0.0.0 for every interface")
    parser.add_argument("--port", type=int, default=29400, help="port to listen on (default: 29400)")
    parser.add_argument("--run-id", help="exit when this run is closed for good and acknowledged")
    parser.add_argument("--grace-timeout", type=float, default=3.0,
                        help="after the close, wait at most this long for acknowledgements (s)")
    parser.add_argument("--linger", type=float, default=30.0,
                        help="then keep serving this long (s), so that a participant of the run that starts late "
                             "learns that the run is over and exits 0 instead of hosting a store of its own and "
                             "waiting for peers that are gone (default: 30)")
    return parser


def serve(host: str, port: int, run_id: str | None, grace_timeout: float,
          stop_requested: Callable[[], bool] = lambda: False, linger: float = 0.0) -> int:
    try:
        signer = job_signer()
    except SecretError as exc:
        log.error("%s", exc)
        return 2
    try:
        store = host_store(host, port, datetime.timedelta(seconds=60))
    except (RuntimeError, OSError) as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        return 2
    publish_launch_id(store, signer)  # a new store is a new launch (see read_launch_id)
    print(f"lightning-ft store listening on {host}:{store.port}", flush=True)
    values = SealedStore(store, signer)
    while not stop_requested():
        if run_id:
            # the incarnation in progress (a run id may be launched again on a long-lived store)
            incarnation = current_incarnation(store, signer, run_id)
            if incarnation is None:  # tampered with: judge the one seen last
                time.sleep(0.5)
                continue
            keys = RunKeys(run_id, incarnation)
            raw = values.get(values.unlisted(keys.closed_for_good))
            reason = CloseReason.decode(raw) if raw is not None else None
            if reason is not None:
                log.info("run %s closed for good (%s); waiting for acknowledgements", run_id, reason)
                wait_for_acknowledgements(RunRecords(store, signer, keys), grace_timeout)
                if linger > 0:
                    log.info("serving %.0fs more for participants that start late", linger)
                    deadline = monotonic() + linger
                    while monotonic() < deadline and not stop_requested():
                        time.sleep(min(0.5, max(0.0, deadline - monotonic())))
                return 0
        # short slices (SIGTERM/SIGINT are handled between them), not shorter: each check is a
        # request to the store, and the store host may share its cores with training
        time.sleep(0.5)
    log.info("store server stopping on request")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 0 <= args.port < 65536:
        print(f"lightning-ft store: --port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    if not args.grace_timeout > 0:
        print(f"lightning-ft store: --grace-timeout must be positive, got {args.grace_timeout}", file=sys.stderr)
        return 2
    if not args.linger >= 0:
        print(f"lightning-ft store: --linger must be >= 0, got {args.linger}", file=sys.stderr)
        return 2
    ensure_log_output()
    stop = {"requested": False}

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return serve(args.host, args.port, args.run_id, args.grace_timeout, lambda: stop["requested"], args.linger)


if __name__ == "__main__":
    sys.exit(main())

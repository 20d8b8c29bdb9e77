"""Make reverse lookups of the loopback address answer from ``/etc/hosts`` on a test machine.

torch's TCPStore client formats the address of every connection it opens with ``getnameinfo``
(no ``NI_NUMERICHOST``): a reverse DNS lookup per connection. The tests connect to
``127.0.0.1``, which torch reaches over an IPv6 socket as ``::ffff:127.0.0.1``; glibc finds no
``/etc/hosts`` line for that form and asks the DNS server. Where that server drops a query now
and then (measured on our CI machines: about one connection in 25), the connection stalls for
glibc's 5 s resolver timeout -- 120 connections took 20 s instead of 0.06 s. One hosts line
for the mapped form answers the lookup locally.
"""

from __future__ import annotations

import os
from pathlib import Path

HOSTS = Path("/etc/hosts")
LINE = "::ffff:127.0.0.1 localhost-v4mapped  # added by lightning_ft's tests: see tests/loopback_dns.py\n"


def has_mapped_loopback(text: str) -> bool:
    return any(line.split()[:1] == ["::ffff:127.0.0.1"] for line in text.splitlines() if not line.startswith("#"))


def ensure_fast_loopback_reverse_lookup(hosts: Path = HOSTS) -> str:
    """Add the hosts line unless it is there; returns what was done (for the session header)."""
    try:
        text = hosts.read_text()
    except OSError as exc:
        return f"cannot read {hosts}: {exc}"
    if has_mapped_loopback(text):
        return "present"
    if os.geteuid() != 0:
        return f"missing (not root): add '{LINE.split('  #')[0]}' to {hosts}, or store connections may stall 5 s"
    with hosts.open("a") as f:
        f.write(("" if text.endswith("\n") or not text else "\n") + LINE)
    return "added"

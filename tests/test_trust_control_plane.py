"""Sealing control-plane values with the job secret, the secret's sources, and incarnations
(issue 10). Pure decisions plus a real TCPStore; the attacker with real processes is in
``test_trust_processes.py``."""

from __future__ import annotations

import logging
import os
import time

import pytest

from lightning_ft.rendezvous.decisions import choose_incarnation
from lightning_ft.rendezvous.records import current_incarnation, resolve_incarnation
from lightning_ft.schema.run import CloseKind, CloseReason, RunKeys
from lightning_ft.schema.signing import ENV_SECRET, ENV_SECRET_FILE, SealedStore, SecretError, Signer, read_secret
from lightning_ft.store.locator import NoRunningJob

KEY = "lightning_ft/job/i0/r3/job/member/1"


def test_a_sealed_value_opens_only_with_the_same_secret_and_key():
    signer = Signer(b"s3cret")
    sealed = signer.seal(KEY, "payload")
    assert sealed != b"payload"
    assert signer.open(KEY, sealed) == b"payload"
    assert Signer(b"other").open(KEY, sealed) is None            # another job's secret
    assert signer.open(KEY.replace("r3", "r4"), sealed) is None  # replayed under another key
    tampered = sealed[:-1] + b"X"
    assert signer.open(KEY, tampered) is None
    assert signer.open(KEY, b"payload") is None                  # unsealed, written by anyone
    assert signer.open(KEY, None) is None


def test_without_a_secret_values_pass_through_but_sealed_ones_are_refused(caplog):
    plain = Signer(None)
    assert not plain.enabled
    assert plain.seal(KEY, "v") == b"v" and plain.open(KEY, b"v") == b"v"
    with caplog.at_level(logging.WARNING):
        assert plain.open(KEY, Signer(b"s").seal(KEY, "v")) is None
        assert plain.open(KEY.replace("/1", "/2"), Signer(b"s").seal(KEY, "v")) is None
    warnings = [r for r in caplog.records if "ignored the value" in r.getMessage()]
    assert len(warnings) == 1, "one warning per kind of key, not one per read"
    assert "no job secret" in warnings[0].getMessage()


def test_secret_file_must_be_a_private_regular_file_of_this_user(tmp_path):
    good = tmp_path / "secret"
    good.write_text("abc\n")
    good.chmod(0o600)
    assert read_secret({ENV_SECRET_FILE: str(good)}) == (b"abc", f"{ENV_SECRET_FILE}={good}")

    readable = tmp_path / "readable"
    readable.write_text("abc")
    readable.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        read_secret({ENV_SECRET_FILE: str(readable)})
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(SecretError, match="cannot open"):
        read_secret({ENV_SECRET_FILE: str(link)})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(SecretError, match="empty"):
        read_secret({ENV_SECRET_FILE: str(empty)})
    with pytest.raises(SecretError, match="cannot open"):
        read_secret({ENV_SECRET_FILE: str(tmp_path / "missing")})
    with pytest.raises(SecretError, match="not a regular file"):
        read_secret({ENV_SECRET_FILE: str(tmp_path)})
    with pytest.raises(SecretError, match="empty"):
        read_secret({ENV_SECRET: "  "})
    assert read_secret({ENV_SECRET: "xyz"}) == (b"xyz", ENV_SECRET)
    assert read_secret({}) == (None, "")


def test_put_if_absent_overwrites_a_forged_value_and_keeps_an_authentic_one(tcp_store):
    values = SealedStore(tcp_store, Signer(b"job"), "lightning_ft/run/i0")
    tcp_store.set(values.key("closed"), b"forged by a client without the secret")
    assert values.get("closed") is None
    assert values.put_if_absent("closed", "first") == b"first"
    assert values.put_if_absent("closed", "second") == b"first"
    assert tcp_store.get(values.key("closed")) != b"first"  # what is stored is sealed


def test_unlisted_names_need_the_secret(tcp_store):
    sealed = SealedStore(tcp_store, Signer(b"job"))
    other = SealedStore(tcp_store, Signer(b"another job"))
    plain = SealedStore(tcp_store, Signer(None))
    name = "lightning_ft/run/i0/closed_for_good"
    assert sealed.unlisted(name).startswith(name + ".") and len(sealed.unlisted(name)) > len(name) + 16
    assert sealed.unlisted(name) == SealedStore(tcp_store, Signer(b"job")).unlisted(name)
    assert other.unlisted(name) != sealed.unlisted(name)
    assert plain.unlisted(name) == name


def test_incarnation_decision():
    assert choose_incarnation(0, None, started_at=100.0) == 0        # open: join it
    assert choose_incarnation(0, 200.0, started_at=100.0) == 0       # a late starter of that launch
    assert choose_incarnation(0, 200.0, started_at=300.0) == 1       # a new launch of the run id
    assert choose_incarnation(4, 200.0, started_at=300.0) == 5


@pytest.mark.parametrize("secret", [None, b"job"])
def test_a_new_launch_after_close_opens_the_next_incarnation_once(tcp_store, secret):
    signer = Signer(secret)
    run = f"run-{secret}"
    now = time.time()
    assert resolve_incarnation(tcp_store, signer, run, started_at=now) == 0
    values = SealedStore(tcp_store, signer)
    closed = CloseReason(CloseKind.FINISHED, "done", closed_at=now + 1)
    values.put_if_absent(values.unlisted(RunKeys(run, 0).closed_for_good), closed.encode())
    assert resolve_incarnation(tcp_store, signer, run, started_at=now) == 0       # late starter
    assert resolve_incarnation(tcp_store, signer, run, started_at=now + 2) == 1   # requeue
    assert resolve_incarnation(tcp_store, signer, run, started_at=now + 3) == 1   # its peers join it


def test_a_restarted_node_finding_its_jobs_store_after_the_end_starts_nothing(tcp_store):
    """A node its scheduler restarted (``rejoin``) reaches the store of a job that ended before it
    started (a store that outlives its job): no running job -- it never opens the next incarnation
    and waits there for peers that are not coming."""
    signer = Signer(b"job")
    now = time.time()
    assert resolve_incarnation(tcp_store, signer, "ended", started_at=now) == 0
    values = SealedStore(tcp_store, signer)
    closed = CloseReason(CloseKind.FINISHED, "done", closed_at=now + 1)
    values.put_if_absent(values.unlisted(RunKeys("ended", 0).closed_for_good), closed.encode())
    assert resolve_incarnation(tcp_store, signer, "ended", started_at=now, rejoin=True) == 0  # it ran then
    with pytest.raises(NoRunningJob, match="its job ended .* no running job to rejoin"):
        resolve_incarnation(tcp_store, signer, "ended", started_at=now + 2, rejoin=True)
    assert current_incarnation(tcp_store, signer, "ended") == 0


def test_a_forged_close_does_not_move_a_sealed_run_to_a_new_incarnation(tcp_store):
    signer = Signer(b"job")
    now = time.time()
    forged = CloseReason(CloseKind.FINISHED, "forged", closed_at=now - 10).encode()
    name = RunKeys("guarded", 0).closed_for_good
    tcp_store.set(name, forged)
    tcp_store.set(SealedStore(tcp_store, Signer(None)).unlisted(name), forged)
    tcp_store.set(name, Signer(b"wrong").seal(name, forged))
    assert resolve_incarnation(tcp_store, signer, "guarded", started_at=now) == 0


def test_secret_value_never_appears_in_the_store(tcp_store):
    secret = os.urandom(16).hex().encode()
    values = SealedStore(tcp_store, Signer(secret), "p")
    values.put("k", "value")
    assert secret not in tcp_store.get("p/k")


def test_an_unusable_secret_is_a_configuration_error_at_every_entry_point(tmp_path, monkeypatch):
    """Trainer construction, ``lightning-ft store`` and the torchrun backend name the secret's
    problem up front (never a traceback from inside fit() or the rendezvous)."""
    import subprocess
    import sys

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from lightning_ft.launch.torchrun import create_handler
    from lightning_ft.rendezvous.settings import RendezvousConfigError
    from lightning_ft.runtime.settings import StrategyConfigError
    from lightning_ft.schema.signing import job_signer
    from lightning_ft.strategy import FaultTolerantDDPStrategy

    bad = tmp_path / "secret"
    bad.write_text("abc")
    bad.chmod(0o640)
    monkeypatch.setenv(ENV_SECRET_FILE, str(bad))
    with pytest.raises(StrategyConfigError, match="chmod 600"):
        FaultTolerantDDPStrategy(endpoint="127.0.0.1:1", run_id="r", min_nodes=1, max_nodes=1)
    job_signer.cache_clear()
    try:
        with pytest.raises(RendezvousConfigError, match="chmod 600"):
            create_handler(RendezvousParameters("lightning_ft", "127.0.0.1:1", "r", 1, 1))
    finally:
        job_signer.cache_clear()
    store = subprocess.run([sys.executable, "-m", "lightning_ft.cli", "store", "--host", "127.0.0.1", "--port", "0"],
                           capture_output=True, text=True, timeout=60, env={**os.environ})
    assert store.returncode == 2 and "chmod 600" in store.stderr, store

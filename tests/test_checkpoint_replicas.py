"""Snapshot replicas for hot spares, in one process with a real TCPStore: only with a job secret,
encrypted in the store, checked from their meta before a byte is read (issue 24, findings 2-4).
The same with real processes and an attacker client: ``test_replica_trust.py``."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_ft.checkpoint.exchange import replication
from lightning_ft.checkpoint.exchange.replication import (
    ReplicaPublisher,
    ReplicaPuller,
    put_replica,
    replica_cipher,
)
from lightning_ft.checkpoint.identity import (
    ExpectedIdentity,
    SnapshotIdentity,
    state_dict_fingerprint,
)
from lightning_ft.checkpoint.memory.store import SnapshotStore
from lightning_ft.checkpoint.policy import replica_header_mismatch, replica_refusal
from lightning_ft.schema.encryption import REPLICA_KEY_LABEL, ReplicaCipher, chunk_spans
from lightning_ft.schema.round import (
    REPLICA_META_KEY,
    ReplicaMeta,
    decode_replica_meta,
    encode_member,
    encode_replica_meta,
    member_key,
    replica_chunk_key,
)
from lightning_ft.schema.signing import SealedStore, Signer

PREFIX = "lightning_ft/job/i0/r0/job"
SECRET = b"the-job-secret"
STATE = {"state_dict": {"w": torch.full((3000,), 3.25), "b": torch.arange(7, dtype=torch.float32)}}
MODEL = state_dict_fingerprint(STATE["state_dict"])


def cipher(secret: bytes = SECRET) -> ReplicaCipher:
    return ReplicaCipher.for_job(Signer(secret))


def meta(**changes) -> ReplicaMeta:
    fields = {"step": 40, "active_domains": ("host-a",), "run_id": "job", "model": MODEL, "nbytes": 10_000,
              "chunk_bytes": 4096}
    return ReplicaMeta(**{**fields, **changes})


# ------------------------------------------------------------------ the cipher


def test_a_sealed_chunk_opens_only_with_the_job_key_at_its_key_and_position():
    sealed = cipher().seal("k/1", 1, 3, 9000, b"weights")
    assert b"weights" not in sealed
    assert cipher().open("k/1", 1, 3, 9000, sealed) == b"weights"
    for other in [("k/2", 1, 3, 9000), ("k/1", 0, 3, 9000), ("k/1", 1, 2, 9000), ("k/1", 1, 3, 9001)]:
        assert cipher().open(*other, sealed) is None, other  # moved, reordered, of another snapshot
    assert cipher(b"another job").open("k/1", 1, 3, 9000, sealed) is None
    assert cipher().open("k/1", 1, 3, 9000, sealed[:-1] + bytes([sealed[-1] ^ 1])) is None
    assert cipher().open("k/1", 1, 3, 9000, b"short") is None
    assert sealed != cipher().seal("k/1", 1, 3, 9000, b"weights")  # a fresh nonce every time


def test_the_replica_key_is_derived_and_there_is_none_without_a_secret():
    key = Signer(SECRET).derived_key(REPLICA_KEY_LABEL)
    assert len(key) == 32 and SECRET not in key and key != Signer(SECRET).derived_key(b"another use")
    assert Signer(None).derived_key(REPLICA_KEY_LABEL) is None and ReplicaCipher.for_job(Signer(None)) is None


def test_chunk_spans_cover_the_value_once():
    assert chunk_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunk_spans(8, 4) == [(0, 4), (4, 4)]
    assert chunk_spans(0, 4) == [(0, 0)]


# ------------------------------------------------------------------ the meta and the rules


def test_the_meta_carries_identity_and_size_and_anything_malformed_is_none():
    assert decode_replica_meta(encode_replica_meta(meta()).encode()) == meta()
    assert meta(nbytes=10_000, chunk_bytes=4096).chunks == 3 and meta(nbytes=0).chunks == 1
    for raw in [b"40\x1fhost-a", b"[]", b'{"step": 1}', b"\xff",
                encode_replica_meta(meta(nbytes=-1)).encode(), encode_replica_meta(meta(chunk_bytes=0)).encode(),
                encode_replica_meta(meta()).replace('"step":40', '"step":"40"').encode(),
                encode_replica_meta(meta()).replace('["host-a"]', '"host-a"').encode()]:
        assert decode_replica_meta(raw) is None, raw


def test_a_replica_of_another_run_or_model_or_too_large_is_refused_from_its_meta():
    expected = ExpectedIdentity("job", MODEL)
    assert replica_refusal(meta(), expected, max_bytes=1 << 20) is None
    assert "run 'other'" in replica_refusal(meta(run_id="other"), expected, 1 << 20)
    assert "different model" in replica_refusal(meta(model="0123456789abcdef"), expected, 1 << 20)
    assert replica_refusal(meta(model="0123456789abcdef"), ExpectedIdentity("job"), 1 << 20) is None  # model unknown
    assert "replica_max_bytes=1048576" in replica_refusal(meta(nbytes=1 << 40), expected, 1 << 20)
    assert "chunks of 1 bytes" in replica_refusal(meta(chunk_bytes=1), expected, 1 << 20)
    assert "no run id" in replica_refusal(meta(run_id=""), ExpectedIdentity(""), 1 << 20)


def test_a_header_that_differs_from_the_meta_is_named():
    found = SnapshotIdentity("job", 0, 40, MODEL)
    assert replica_header_mismatch(meta(), 40, 10_000, found) is None
    assert "size 10000" in replica_header_mismatch(meta(), 40, 1 << 40, found)
    assert "step 40" in replica_header_mismatch(meta(), 100_000, 10_000, found)
    assert "model" in replica_header_mismatch(meta(), 40, 10_000, SnapshotIdentity("job", 0, 40, "other"))


def test_without_a_secret_there_are_no_replicas_and_one_warning_says_how_to_turn_them_on(caplog):
    replication._warn_replicas_off.cache_clear()
    with caplog.at_level(logging.WARNING, logger=replication.__name__):
        assert replica_cipher(Signer(None), 1) is None
        assert replica_cipher(Signer(None), 1) is None
    [record] = [r for r in caplog.records if "replicas" in r.message]
    assert "no secret" in record.message and "same secret" in record.message and "docs/trust.md" in record.message
    assert replica_cipher(Signer(None), 0) is None and replica_cipher(Signer(SECRET), 0) is None
    assert replica_cipher(Signer(SECRET), 1) is not None


# ------------------------------------------------------------------ publisher and puller over a real store


class Events(list):
    def __call__(self, event, **fields):
        self.append((event, fields))

    def named(self, event):
        return [fields for name, fields in self if name == event]


@pytest.fixture
def snapshot(tmp_path):
    store = SnapshotStore(root=tmp_path / "active", run_id="job", rank=0)
    return store, store.save(STATE, step=40)


def publish(tcp_store, info, monkeypatch, chunk_bytes=4096):
    monkeypatch.setattr(replication, "REPLICA_CHUNK_BYTES", chunk_bytes)
    signer = Signer(SECRET)
    SealedStore(tcp_store, signer, PREFIX).put(member_key(0), encode_member("p0", "host-a"))
    events = Events()
    publisher = ReplicaPublisher(lambda: tcp_store, signer, cipher(), 1, 1 << 30, events)
    publisher.offer(info, 0, PREFIX, 1)
    publisher.stop()
    assert events.named("replica_published"), events
    return publisher


def make_puller(tmp_path, events, model=MODEL, max_bytes=1 << 30):
    return ReplicaPuller("host-b", 1, lambda: SnapshotStore(root=tmp_path / "spare", run_id="job", rank=0), events,
                         cipher=cipher(), expected=ExpectedIdentity("job", model), max_bytes=max_bytes)


def test_a_published_replica_is_encrypted_in_the_store_and_kept_whole_by_the_spare(tcp_store, snapshot, tmp_path,
                                                                                  monkeypatch):
    store, info = snapshot
    publish(tcp_store, info, monkeypatch)
    plain = store.read_bytes(info)
    stored = b"".join(tcp_store.get(k) for k in tcp_store.list_keys() if "/replica/blob/" in k)
    assert len(stored) > len(plain)
    weights = STATE["state_dict"]["w"][:16].numpy().tobytes()
    assert weights in plain and weights not in stored  # a store client reads no weights
    events = Events()
    make_puller(tmp_path, events).poll(SealedStore(tcp_store, Signer(SECRET), PREFIX))
    assert events.named("replica_received") == [{"step": 40, "bytes": len(plain)}], events
    spare = SnapshotStore(root=tmp_path / "spare", run_id="job", rank=0)
    assert torch.equal(spare.load()["state_dict"]["w"], STATE["state_dict"]["w"])


def test_a_third_publication_removes_the_first_and_keeps_the_one_before(tcp_store, snapshot, monkeypatch):
    store, info = snapshot
    publisher = publish(tcp_store, info, monkeypatch)
    for step in (50, 60):
        publisher.offer(store.save(STATE, step=step), 0, PREFIX, 1)
        publisher.stop()
    steps = {int(k.split("/")[-2]) for k in tcp_store.list_keys() if "/replica/blob/" in k}
    assert steps == {50, 60}


def watch_reads_and_allocations(monkeypatch) -> tuple[list, list]:
    """(store keys of replica bytes read, sizes of replica buffers allocated) by a puller from now on."""
    read, allocated = [], []
    real_read = replication.get_if_present
    monkeypatch.setattr(replication, "get_if_present", lambda store, key: read.append(key) or real_read(store, key))
    monkeypatch.setattr(replication, "bytearray", lambda n: allocated.append(n) or bytearray(n), raising=False)
    return read, allocated


@pytest.mark.parametrize("announced, reason", [
    ({"model": "0123456789abcdef"}, "different model"),
    ({"run_id": "other-job"}, "belongs to run 'other-job'"),
    ({"nbytes": 1 << 40}, "replica_max_bytes"),
])
def test_a_replica_announced_as_another_model_run_or_size_is_refused_before_a_byte_is_read(
        tcp_store, snapshot, tmp_path, monkeypatch, announced, reason):
    _, info = snapshot
    publish(tcp_store, info, monkeypatch)
    values = SealedStore(tcp_store, Signer(SECRET), PREFIX)
    genuine = decode_replica_meta(values.get(REPLICA_META_KEY))
    values.put(REPLICA_META_KEY, encode_replica_meta(genuine._replace(**announced)))  # by a holder of the secret
    read, allocated = watch_reads_and_allocations(monkeypatch)
    events = Events()
    make_puller(tmp_path, events, max_bytes=1 << 20).poll(values)
    [refused] = events.named("replica_refused")
    assert refused["stage"] == "meta" and reason in refused["error"], refused
    assert not read and not allocated and not events.named("replica_received")
    assert SnapshotStore(root=tmp_path / "spare", run_id="job", rank=0).list() == []


def test_a_replica_whose_header_is_not_what_its_meta_announces_is_refused_before_allocation(
        tcp_store, snapshot, tmp_path, monkeypatch):
    store, info = snapshot
    blob = store.read_bytes(info)
    values = SealedStore(tcp_store, Signer(SECRET), PREFIX)
    # consistently sealed by a holder of the secret, but the snapshot inside is step 40's
    put_replica(values, cipher(), meta(step=100_000, nbytes=len(blob)), blob)
    read, allocated = watch_reads_and_allocations(monkeypatch)
    events = Events()
    make_puller(tmp_path, events).poll(values)
    [refused] = events.named("replica_refused")
    assert refused["stage"] == "header" and "step 100000" in refused["error"], refused
    assert len(read) == 1 and not allocated and not events.named("replica_received")


def test_chunks_moved_between_steps_or_forged_without_the_key_are_refused(tcp_store, snapshot, tmp_path, monkeypatch):
    store, info = snapshot
    publisher = publish(tcp_store, info, monkeypatch)
    publisher.offer(store.save(STATE, step=50), 0, PREFIX, 1)
    publisher.stop()
    values = SealedStore(tcp_store, Signer(SECRET), PREFIX)
    second = values.key(replica_chunk_key(50, 1))
    tcp_store.set(second, tcp_store.get(values.key(replica_chunk_key(40, 1))))  # same length, another step
    events = Events()
    make_puller(tmp_path, events).poll(values)
    [refused] = events.named("replica_refused")
    assert refused["stage"] == "contents" and "does not open" in refused["error"]
    tcp_store.set(values.key(replica_chunk_key(50, 0)), b"x" * 4124)  # forged by a client without the key
    values.put(REPLICA_META_KEY, values.get(REPLICA_META_KEY) + b" ")  # the same meta, seen anew
    make_puller(tmp_path, events).poll(values)
    assert [e["stage"] for e in events.named("replica_refused")] == ["contents", "header"]
    assert not events.named("replica_received")

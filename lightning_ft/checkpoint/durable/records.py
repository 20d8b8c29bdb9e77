"""Done markers and manifests as stored: bound to their run and model, sealed with the job secret
when there is one, and checked field by field before anything in them becomes a path.

Whoever can write the durable storage can write a marker or a manifest, so what one says is
not taken on trust:

* *bound*: every record names the run id and the fingerprint of the model its shards hold
  (:mod:`lightning_ft.checkpoint.identity`); the reader compares them with its own
  (:func:`record_mismatch`), so a job never resumes another run's or another model's step;
* *sealed*: with a job secret (``LIGHTNING_FT_SECRET_FILE`` or ``LIGHTNING_FT_SECRET``) a record
  is sealed like a store value (:class:`lightning_ft.schema.signing.Signer`: HMAC-SHA256 over
  the record's path under the target and its bytes), so one written without the secret or with
  another, altered, or moved to another step or run is refused;
* *checked*: steps, ranks, world sizes and sizes must be JSON integers >= 0 and a timeline a
  plain name (:data:`PLAIN_NAME`: letters, digits, ``-`` and ``_``, no separator, no ``..``),
  because they become directory and file names under the target.

Pure functions, no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lightning_ft.checkpoint.identity import ExpectedIdentity, SnapshotIdentity, identity_mismatch
from lightning_ft.checkpoint.tiers import Completion, ShardMarker
from lightning_ft.schema.signing import Signer

#: what a name taken from a record may be before it becomes a path component
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
CHECKSUM_KIND = "snapshot-crc32:"


def plain_name(raw: Any, what: str) -> str:
    """``raw`` if it is a :data:`PLAIN_NAME`, else ValueError saying which field and why."""
    if not (isinstance(raw, str) and PLAIN_NAME.fullmatch(raw)):
        raise ValueError(f"{what} {raw!r} is not a plain name (letters, digits, '-' and '_'; "
                         "no path separator, no '..')")
    return raw


def whole_number(raw: Any, what: str) -> int:
    """``raw`` if it is a JSON integer >= 0 (not a bool, a float or a string), else ValueError."""
    if type(raw) is not int or raw < 0:
        raise ValueError(f"{what} {raw!r} is not a whole number >= 0")
    return raw


def checked_checksum(raw: Any) -> str:
    """A checksum read from a marker or manifest; another kind (an earlier build's) is unreadable."""
    if not (isinstance(raw, str) and raw.startswith(CHECKSUM_KIND)):
        raise ValueError(f"checksum {raw!r} is not a {CHECKSUM_KIND}... value")
    return raw


def _text(raw: Any, what: str) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"{what} {raw!r} is not text")
    return raw


def marker_record(marker: ShardMarker, run_id: str) -> dict[str, Any]:
    """A done marker as stored: JSON whose timeline field is named ``segment`` (its name on storage)."""
    return {"step": marker.step, "segment": marker.timeline, "rank": marker.rank, "world_size": marker.world_size,
            "nbytes": marker.nbytes, "checksum": marker.checksum, "run_id": run_id, "model": marker.model}


def parse_marker(raw: Any) -> tuple[str, ShardMarker]:
    """(run id, marker) of a stored done marker; ValueError/KeyError/TypeError if it is not one."""
    marker = ShardMarker(whole_number(raw["step"], "step"), plain_name(raw["segment"], "timeline"),
                         whole_number(raw["rank"], "rank"), whole_number(raw["world_size"], "world size"),
                         whole_number(raw["nbytes"], "size"), checked_checksum(raw["checksum"]),
                         _text(raw["model"], "model"))
    return _text(raw["run_id"], "run id"), marker


def manifest_record(completion: Completion, run_id: str) -> dict[str, Any]:
    """A manifest as stored (every rank that writes it writes the same bytes: see :func:`encode`)."""
    return {"step": completion.step, "segment": completion.timeline, "world_size": completion.world_size,
            "run_id": run_id, "model": completion.model,
            "shards": [{"rank": r, "nbytes": n, "checksum": c} for r, n, c in completion.shards]}


def parse_manifest(raw: Any) -> tuple[str, Completion]:
    """(run id, completion) of a stored manifest; ValueError/KeyError/TypeError if it is not one."""
    shards = tuple((whole_number(s["rank"], "rank"), whole_number(s["nbytes"], "size"), checked_checksum(s["checksum"]))
                   for s in raw["shards"])
    completion = Completion(whole_number(raw["step"], "step"), plain_name(raw["segment"], "timeline"),
                            whole_number(raw["world_size"], "world size"), shards, _text(raw["model"], "model"))
    return _text(raw["run_id"], "run id"), completion


def finished_record(run_id: str, step: int, epoch: int) -> dict[str, Any]:
    """The record that a run's training finished, at ``step`` in ``epoch``."""
    return {"run_id": run_id, "finished_step": step, "finished_epoch": epoch}


def parse_finished(raw: Any) -> tuple[str, int, int]:
    """(run id, step, epoch) of a stored finished record; ValueError/KeyError/TypeError if it is not one."""
    return (_text(raw["run_id"], "run id"), whole_number(raw["finished_step"], "step"),
            whole_number(raw["finished_epoch"], "epoch"))


def record_mismatch(run_id: str, model: str, step: int, expected: ExpectedIdentity) -> str | None:
    """Why a record of ``run_id`` and ``model`` must not be used by ``expected``; None if it fits."""
    return identity_mismatch(SnapshotIdentity(run_id, rank=-1, step=step, model=model),
                             ExpectedIdentity(expected.run_id, expected.model))


def _seal_key(path: str) -> str:
    # a name of its own: a sealed store value is never accepted as a record, nor the reverse
    return f"durable:{path}"


def encode(signer: Signer, path: str, record: dict[str, Any]) -> bytes:
    """The bytes stored at ``path`` for ``record`` (sealed when ``signer`` has a secret)."""
    return signer.seal(_seal_key(path), json.dumps(record, sort_keys=True).encode())


def decode(signer: Signer, path: str, raw: bytes) -> Any:
    """The JSON value stored at ``path``; SealError (a ValueError) when it is not authentic,
    ValueError when it is not JSON."""
    return json.loads(signer.unseal(_seal_key(path), raw))

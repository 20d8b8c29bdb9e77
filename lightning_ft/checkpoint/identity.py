"""Whose a snapshot is: the identity every snapshot file carries, and the rules for accepting one.

A snapshot records the run id it was written under, the global rank whose state it holds, its
step and a fingerprint of the model (:func:`model_fingerprint`). A resume names what it expects
(:class:`ExpectedIdentity`) and :func:`identity_mismatch` says why a snapshot does not fit, so a
job never resumes another job's weights or a different model's. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ft.checkpoint.sharded import is_shard_record

FINGERPRINT_CHARS = 16


@dataclass(frozen=True)
class SnapshotIdentity:
    """Who wrote a snapshot; stored in the file and covered by its checksum.

    ``run_id`` is ``""`` when no run id was configured (such snapshots are never resumed).
    ``rank`` is the global rank that took the snapshot; a copy sent to another rank (transfer,
    replica) keeps it: DDP ranks hold the same state, so it records provenance, not a target.
    ``model`` is :func:`model_fingerprint` of the state (``""`` without a ``state_dict``).
    """

    run_id: str
    rank: int
    step: int
    model: str


@dataclass(frozen=True)
class ExpectedIdentity:
    """What a resume accepts: this ``run_id``; ``model`` (a fingerprint) and ``rank`` when not None."""

    run_id: str
    model: str | None = None
    rank: int | None = None


def _dtype_kind(value: torch.Tensor) -> str:
    # Precision plugins cast the module ("bf16-true" after a restore from an explicit ckpt_path,
    # before it for auto-resume), and Lightning loads a state of one float width into another;
    # the width says nothing about whether it is the same model, the kind of number does.
    if value.is_floating_point():
        return "float"
    if value.is_complex():
        return "complex"
    return str(value.dtype).removeprefix("torch.")


def state_dict_fingerprint(state_dict: Mapping[str, Any]) -> str:
    """Short hash of the sorted (name, shape, kind of dtype) of a model's ``state_dict``.

    Another architecture (names or shapes) gives another fingerprint; other weights, learning
    rates or seeds do not (that is what the run id separates). Non-tensor entries count by type.
    """
    entries = []
    for name in sorted(state_dict):
        value = state_dict[name]
        if isinstance(value, torch.Tensor):  # a DTensor's shape is the global one
            entries.append(f"{name}|{list(value.shape)}|{_dtype_kind(value)}")
        elif is_shard_record(value):  # its DTensor as a snapshot holds it: the same entry
            entries.append(f"{name}|{list(value['global_shape'])}|{_dtype_kind(value['local'])}")
        else:
            entries.append(f"{name}|{type(value).__qualname__}")
    return hashlib.sha256("\n".join(entries).encode("utf-8", "surrogatepass")).hexdigest()[:FINGERPRINT_CHARS]


def model_fingerprint(state: Any) -> str:
    """Fingerprint of ``state["state_dict"]`` (a Lightning checkpoint), ``""`` when there is none."""
    if isinstance(state, Mapping):
        state_dict = state.get("state_dict")
        if isinstance(state_dict, Mapping):
            return state_dict_fingerprint(state_dict)
    return ""


def identity_mismatch(found: SnapshotIdentity, expected: ExpectedIdentity) -> str | None:
    """Why a snapshot with identity ``found`` must not be resumed by ``expected``; None if it fits."""
    if not expected.run_id:
        return "no run id is configured, so no snapshot can be shown to belong to this job"
    if not found.run_id:
        return "it was written without a run id, so it may belong to any job"
    if found.run_id != expected.run_id:
        return f"it belongs to run {found.run_id!r}, not to this run {expected.run_id!r}"
    if expected.model is not None and found.model != expected.model:
        return (f"it was taken from a different model (parameter names or shapes differ: fingerprint "
                f"{found.model or 'none'}, this model {expected.model})")
    if expected.rank is not None and found.rank != expected.rank:
        return f"it holds rank {found.rank}'s state, not rank {expected.rank}'s (state is not replicated)"
    return None

"""The model a stage starts from, on every participant of its round.

A hot spare that stood by in a ``fit()`` still holds the model it started with; when a later stage
(a test after a lost node, a second fit whose actives changed) makes it active, it must start from
what the actives hold, as it would under ``ddp`` where every process ran every stage. Each process
knows which ``fit()`` stage its module state is from (``Session.trained_through``: the last fit it
finished as an active, or whose state it received); when the round's group forms, the ranks compare
that number and the ones behind receive the module's parameters and buffers from the lowest rank
with the newest. A ``ckpt_path`` of ``"best"``/``"last"`` (or none, with no model given: Lightning's
``"best"``) names the checkpoint of the previous ``fit()``; a process that did not finish that fit
as an active does not know it, so the fit's rank 0 publishes the paths and such a process takes
them from there.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: the state of a process that never finished a fit as an active (nor received one's)
NO_FIT = -1


@dataclass(frozen=True)
class FitCheckpointPaths:
    """What ``ckpt_path="best"`` and ``"last"`` named at the end of the job's ``fit()`` stage ``stage``
    (its rank 0's first ``ModelCheckpoint``; empty strings when it saved none)."""

    stage: int
    best: str
    last: str

    def encode(self) -> bytes:
        return json.dumps({"stage": self.stage, "best": self.best, "last": self.last}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> FitCheckpointPaths | None:
        """The published paths; None for a value that is not what :meth:`encode` writes."""
        try:
            data = json.loads(raw)
            return cls(int(data["stage"]), str(data["best"]), str(data["last"]))
        except (ValueError, TypeError, KeyError):
            return None


def checkpoint_path_for(requested: Any, model_given: bool, published: FitCheckpointPaths | None,
                        trained_through: int) -> Any:
    """The ``ckpt_path`` a Trainer call should use on a process whose state is from fit stage
    ``trained_through``: the published path of the newest fit for ``"best"``/``"last"`` (and for none
    when no model was given) when this process does not know it; ``requested`` otherwise."""
    if published is None or trained_through >= published.stage:
        return requested
    wanted = "best" if requested is None and not model_given else requested
    if wanted == "best" and published.best:
        return published.best
    if wanted == "last" and published.last:
        return published.last
    return requested


def newest_state_source(versions: list[int]) -> int | None:
    """The rank whose module state the others should take: the lowest with the newest fit stage;
    None when every rank holds the same."""
    newest = max(versions)
    if all(version == newest for version in versions):
        return None
    return versions.index(newest)


def align_module_state(module: torch.nn.Module, trained_through: int, device: torch.device) -> tuple[int, int] | None:
    """Over the current process group: compare ``trained_through`` and broadcast the module's
    parameters and buffers from :func:`newest_state_source` to every rank. Returns (source rank,
    its stage) when state was sent or received, None when all ranks held the same."""
    mine = torch.tensor([trained_through], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    versions = [int(value.item()) for value in gathered]
    source = newest_state_source(versions)
    if source is None:
        return None
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            data = tensor.detach()
            on_device = data.to(device)  # data itself when it is on the group's device already
            dist.broadcast(on_device, src=source)
            if on_device is not data:
                data.copy_(on_device)
    return source, versions[source]

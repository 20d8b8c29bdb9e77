"""A training loader whose position is part of every snapshot, so a resume is exact.

With a plain ``DataLoader``, Lightning restarts the epoch's iterator at its first batch after any
resume (a recovery, a relaunch), so the batches after the snapshot differ from an uninterrupted
run's (docs/strategy.md, "What exact means"). :func:`resumable_loader` gives a loader that
resumes with exactly the batch that came next: a ``StatefulDataLoader`` (torchdata; ``pip install
'lightning-ft[data]'``) over :class:`ResumableShuffleSampler`. Use it in ``train_dataloader``::

    from lightning_ft.data import resumable_loader

    def train_dataloader(self):
        return resumable_loader(self.train_set, batch_size=32, seed=7, trainer=self.trainer)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, DistributedSampler


class ResumableShuffleSampler(DistributedSampler):
    """This rank's shard of a per-epoch shuffle that counts its own epochs and saves
    ``(epoch, position)`` with the loader's state.

    Why not the usual samplers: Lightning tells a sampler the epoch through ``set_epoch``, and
    after a resume from a snapshot taken at the last step of an epoch its epoch counter is one
    ahead of the uninterrupted run's, so a ``DistributedSampler`` would shuffle every later
    epoch differently; torchdata's single-process ``RandomSampler`` shares its generator with
    the loader's per-epoch seed draw, which a restore does not replay. Counted here and seeded by
    ``seed + epoch``, the order is a pure function of the saved state. ``drop_last``: every step
    sees a full shard on every rank. Lightning keeps a ``DistributedSampler`` it is given instead
    of inserting its own.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.yielded = 0
        self._next_epoch = 0
        self._restored: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Ignored: this sampler counts its epochs itself (see the class docstring)."""

    def __iter__(self) -> Iterator[int]:
        # a generator: nothing happens until the first index is taken, so iterators that are
        # created and dropped (Lightning and torchdata both make spare ones) do not count
        epoch, skip = self._restored if self._restored is not None else (self._next_epoch, 0)
        self._restored = None
        self.epoch, self._next_epoch, self.yielded = epoch, epoch + 1, skip
        for index in list(super().__iter__())[skip:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._restored = (int(state["epoch"]), int(state["yielded"]))
        self._next_epoch = self._restored[0] + 1


def resumable_loader(dataset: Dataset, batch_size: int, trainer: Any, seed: int = 0, **loader_kwargs: Any) -> Any:
    """A shuffling ``StatefulDataLoader`` over :class:`ResumableShuffleSampler` for this process's
    rank of ``trainer`` (call it in ``train_dataloader``: the rank is known then). Needs torchdata
    (``pip install 'lightning-ft[data]'``)."""
    try:  # optional (torchdata ships no type information)
        stateful = importlib.import_module("torchdata.stateful_dataloader")
    except ImportError as exc:
        raise ImportError("resumable_loader needs torchdata: pip install 'lightning-ft[data]'") from exc
    sampler = ResumableShuffleSampler(dataset, trainer.world_size, max(trainer.global_rank, 0), seed)
    return stateful.StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **loader_kwargs)

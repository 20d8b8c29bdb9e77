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
from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import Dataset, DistributedSampler


class ResumableShuffleSampler(DistributedSampler):
    """This rank's shard of a per-epoch shuffle that counts its own epochs and saves
    ``(epoch, position)`` with the loader's state, so a resume continues the epoch exactly, in
    the same world or in a world of another size (an elastic job that shrank or grew).

    Why not the usual samplers: Lightning tells a sampler the epoch through ``set_epoch``, and
    after a resume from a snapshot taken at the last step of an epoch its epoch counter is one
    ahead of the uninterrupted run's, so a ``DistributedSampler`` would shuffle every later
    epoch differently; torchdata's single-process ``RandomSampler`` shares its generator with
    the loader's per-epoch seed draw, which a restore does not replay. Counted here and seeded by
    ``seed + epoch``, the order is a pure function of the saved state. ``drop_last``: every step
    sees a full shard on every rank. Lightning keeps a ``DistributedSampler`` it is given instead
    of inserting its own.

    The epoch's global order is ``DistributedSampler``'s permutation (``torch.randperm`` seeded
    by ``seed + epoch``); a world of ``W`` ranks deals it out interleaved, rank ``r`` taking
    ``order[r::W]``, so after every rank took ``k`` indices exactly ``order[:k * W]`` is spent
    whatever ``W`` was: the *position* ``k * W`` is all a resume needs.

    State (``state_dict``): ``epoch``; ``yielded``, this rank's count in the epoch (after a
    resume in a world of another size: the whole steps of this world the resume position makes,
    plus what it yielded since); ``replicas``, the world size ``W`` it was counted in; ``base``,
    the part of the position that is not a whole number of steps of that world (``0`` unless the
    epoch was resumed in a world of another size). The position is ``base + yielded * replicas``.
    A state without ``replicas``/``base`` (saved before they existed) is read as counted in the
    current world, from ``base`` 0. The ranks' states are equal at a step boundary, so every rank
    of the new world, however many, loads the same one (any old rank's).

    Re-shard rule: a restore at position ``p`` into rank ``r`` of a world of ``W`` continues the
    same epoch with ``order[p:][r::W]``, cut to ``len(order[p:]) // W`` indices on every rank
    (``drop_last``: the last partial step of the epoch is dropped); in an unchanged world that is
    exactly the uninterrupted run's rest of the epoch. An epoch the saving world had finished
    (fewer than one step of that world left) stays finished: a snapshot taken at the end of an
    epoch resumes with an empty rest of the epoch, then the next epoch, in any world. Every later
    epoch is the plain one of the current world.

    ``len(sampler)`` is this rank's full epoch in the current world (``DistributedSampler``'s,
    already-yielded indices included), before and after a restore, as before elastic resumes:
    Lightning reads it once, right after loading the loader's state, and uses it for every later
    epoch, so it must be the full epoch's. A resumed epoch ends with ``yielded`` at ``len`` or,
    after a change of world size at a position not a multiple of ``W``, one short of it.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.yielded = 0
        self.base = 0
        self._next_epoch = 0
        self._restored: tuple[int, int] | None = None  # (epoch, position) for the next __iter__

    def set_epoch(self, epoch: int) -> None:
        """Ignored: this sampler counts its epochs itself (see the class docstring)."""

    def _order(self, epoch: int) -> list[int]:
        """The epoch's global order: what ``DistributedSampler`` shuffles before dealing out."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self._size(), generator=generator).tolist()

    def _size(self) -> int:
        return len(cast(Sized, self.dataset))

    def __iter__(self) -> Iterator[int]:
        # a generator: nothing happens until the first index is taken, so iterators that are
        # created and dropped (Lightning and torchdata both make spare ones) do not count
        epoch, position = self._restored if self._restored is not None else (self._next_epoch, 0)
        self._restored = None
        self._start(epoch, position)
        world = self.num_replicas
        # whole steps of this world left; with position 0 that is DistributedSampler's
        # num_samples, and order[r::W] cut there is its shard, so an unchanged world is unchanged
        steps = (self._size() - position) // world
        for index in self._order(epoch)[position + self.rank : position + steps * world : world]:
            self.yielded += 1
            yield index

    def _start(self, epoch: int, position: int) -> None:
        """Count from ``position`` in this world: ``yielded`` whole steps of it, ``base`` over."""
        self.epoch, self._next_epoch = epoch, epoch + 1
        self.yielded, self.base = divmod(position, self.num_replicas)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded, "replicas": self.num_replicas, "base": self.base}

    def load_state_dict(self, state: dict[str, int]) -> None:
        replicas = int(state.get("replicas", self.num_replicas))  # an old state: this world's
        position = int(state.get("base", 0)) + int(state["yielded"]) * replicas
        if self._size() - position < replicas:
            # the saving world had finished the epoch; its drop_last remainder stays dropped,
            # rather than a new, smaller world taking it as a stray extra step after the end
            position = self._size()
        self._restored = (int(state["epoch"]), position)
        # state_dict() before the first index is taken already reports the restored position
        self._start(*self._restored)


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

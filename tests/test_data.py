"""``lightning_ft.data``: the training loader whose position is part of every snapshot (the order
after a restore is checked in tests/test_examples.py, through the examples that use it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchdata")


def test_resumable_loader_shards_by_the_trainers_rank_and_continues_after_a_restore():
    from lightning_ft.data import ResumableShuffleSampler, resumable_loader

    dataset = torch.utils.data.TensorDataset(torch.arange(32))
    trainer = SimpleNamespace(world_size=2, global_rank=1)
    loader = resumable_loader(dataset, 4, trainer, seed=3)
    assert isinstance(loader.sampler, ResumableShuffleSampler) and loader.sampler.rank == 1
    everything = [b[0].tolist() for b in loader]  # its first epoch
    interrupted = resumable_loader(dataset, 4, trainer, seed=3)
    it = iter(interrupted)
    head = [next(it)[0].tolist() for _ in range(2)]
    again = resumable_loader(dataset, 4, trainer, seed=3)
    again.load_state_dict(interrupted.state_dict())
    assert head + [b[0].tolist() for b in again] == everything
    before_fit = SimpleNamespace(world_size=1, global_rank=-1)  # a spare before its first round
    assert resumable_loader(dataset, 4, before_fit).sampler.rank == 0

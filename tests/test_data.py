"""``lightning_ft.data``: the training loader whose position is part of every snapshot (the order
after a restore is checked in tests/test_examples.py, through the examples that use it), and its
resume in a world of another size (elastic): the epoch goes on from the same global position."""

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


# --- resuming in a world of another size (an elastic job that shrank or grew) -------------------


def _samplers(size: int, world: int, seed: int = 5, state: dict | None = None) -> list:
    """One ResumableShuffleSampler per rank of a world of ``world`` over ``size`` items, each
    restored from ``state`` when given (the elastic restore hands every rank the same state)."""
    from lightning_ft.data import ResumableShuffleSampler

    dataset = torch.utils.data.TensorDataset(torch.arange(size))
    samplers = [ResumableShuffleSampler(dataset, world, rank, seed) for rank in range(world)]
    for sampler in samplers if state is not None else ():
        sampler.load_state_dict(dict(state))
    return samplers


def _order(size: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def _plain_epoch(size: int, world: int, rank: int, seed: int, epoch: int) -> list[int]:
    """What a plain DistributedSampler (shuffle, drop_last) deals this rank: the reference."""
    plain = torch.utils.data.DistributedSampler(
        torch.utils.data.TensorDataset(torch.arange(size)), world, rank, shuffle=True, seed=seed, drop_last=True)
    plain.set_epoch(epoch)
    return list(plain)


def _take(iterator, count: int) -> list[int]:
    return [next(iterator) for _ in range(count)]


@pytest.mark.parametrize(("size", "world"), [(32, 1), (32, 2), (23, 2), (23, 3), (5, 4)])
def test_a_restore_in_the_same_world_continues_exactly_as_before(size, world):
    # bit-identical to the sampler before elastic resumes: the plain shard, cut after `taken`
    for rank in range(world):
        for taken in range(1, size // world + 1):  # 0: the lazy iterator has not begun epoch 1
            sampler = _samplers(size, world)[rank]
            epoch0 = list(sampler)
            assert epoch0 == _plain_epoch(size, world, rank, 5, 0) and len(sampler) == len(epoch0)
            it = iter(sampler)  # epoch 1
            head = _take(it, taken)
            state = sampler.state_dict()
            assert state == {"epoch": 1, "yielded": taken, "replicas": world, "base": 0}
            again = _samplers(size, world, state=state)[rank]
            assert head + list(again) == _plain_epoch(size, world, rank, 5, 1)
            assert list(again) == _plain_epoch(size, world, rank, 5, 2) and len(again) == size // world


def test_an_old_state_without_replicas_is_counted_in_the_current_world():
    for rank in range(2):
        restored = _samplers(23, 2, state={"epoch": 1, "yielded": 3})[rank]
        assert list(restored) == _plain_epoch(23, 2, rank, 5, 1)[3:]
        assert restored.state_dict() == {"epoch": 1, "yielded": 11, "replicas": 2, "base": 0}


@pytest.mark.parametrize(("before", "after", "taken"), [(2, 1, 5), (1, 2, 7), (2, 3, 5), (3, 2, 4), (1, 3, 1)])
def test_a_restore_in_a_world_of_another_size_continues_from_the_same_position(before, after, taken):
    size, epoch = 23, 1
    state = _samplers(size, before, state={"epoch": epoch, "yielded": taken, "replicas": before})[0].state_dict()
    position = taken * before  # every rank of the old world took `taken`: order[:position] is spent
    rest = _order(size, 5, epoch)[position:]
    steps = len(rest) // after  # drop_last: every rank of the new world takes the same count
    restored = _samplers(size, after, state=state)
    for rank, sampler in enumerate(restored):
        assert list(sampler) == rest[rank::after][:steps]
        assert len(sampler) == size // after  # the full epoch of this world (class docstring)
        assert sampler.yielded == position // after + steps <= len(sampler)
        # the epoch after the resumed one is the plain epoch of the new world
        assert list(sampler) == _plain_epoch(size, after, rank, 5, epoch + 1)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (2, 2), (3, 2), (1, 2)])
def test_a_snapshot_at_the_end_of_an_epoch_resumes_with_the_next_epoch_in_any_world(before, after):
    size = 23  # 23 % 2 and 23 % 3 leave a remainder that the saving world dropped: it stays dropped
    saver = _samplers(size, before)[0]
    assert len(list(saver)) == size // before
    state = saver.state_dict()
    for rank, sampler in enumerate(_samplers(size, after, state=state)):
        assert list(sampler) == []  # the rest of the finished epoch 0, as the loader's iterator sees it
        assert list(sampler) == _plain_epoch(size, after, rank, 5, 1)


def _check_elastic_run(size: int, seed: int, plan: list[tuple[int, int]]) -> None:
    """Run an epoch through worlds of the sizes in ``plan``, each for its number of steps (one
    index per rank per step; the last runs out the epoch), snapshotting rank 0 between them, and
    check that each global step spends the next contiguous block of the epoch's order."""
    order, position, state = _order(size, seed, 0), 0, None
    for number, (world, steps) in enumerate(plan):
        samplers = _samplers(size, world, seed, state)
        iterators = [iter(sampler) for sampler in samplers]
        last = number == len(plan) - 1
        for _ in range(size if last else steps):
            step = [next(it, None) for it in iterators]
            if step == [None] * world:
                break
            assert None not in step, "the ranks of a world ran out at different steps"
            assert sorted(step) == sorted(order[position:position + world])
            assert step == order[position:position + world]  # and rank r takes the r-th of it
            position += world
        states = [sampler.state_dict() for sampler in samplers]
        assert all(s == states[0] for s in states)  # any rank's state will do
        state = states[0]
        assert state["base"] + state["yielded"] * state["replicas"] == position
        if size - position < world:
            position = size  # this world finished the epoch: its drop_last remainder stays dropped
    assert position == size  # the last world ran out the epoch


def test_an_epoch_through_worlds_of_changing_size_spends_its_order_in_contiguous_steps():
    import random

    _check_elastic_run(23, 5, [(2, 5), (1, 7), (3, 0)])
    _check_elastic_run(23, 5, [(3, 2), (2, 1), (3, 1), (1, 1), (2, 50)])
    _check_elastic_run(10, 0, [(2, 5), (1, 0)])  # a restore at the exact end of the epoch
    rng = random.Random(11)
    for _ in range(60):
        size = rng.randint(1, 40)
        plan = [(rng.randint(1, 4), rng.randint(0, 8)) for _ in range(rng.randint(1, 5))]
        _check_elastic_run(size, rng.randint(0, 100), plan)


def test_a_loader_state_saved_in_a_world_of_two_restores_into_a_world_of_one():
    """Two ranks save at world 2 after ``taken`` batches each; one loader of world 1 restores
    rank 0's loader state. A global step of world 2 is one micro-batch per rank (2 * batch
    samples); the same step of world 1 is two micro-batches of its single rank (accumulated, so
    the optimizer sees the same samples). Step s after the restore must spend the same samples
    in both worlds, and the epoch after it is the plain epoch of world 1."""
    from lightning_ft.data import resumable_loader

    dataset, batch, taken = torch.utils.data.TensorDataset(torch.arange(40)), 2, 3
    ranks = [SimpleNamespace(world_size=2, global_rank=rank) for rank in range(2)]
    world2 = [resumable_loader(dataset, batch, trainer, seed=3) for trainer in ranks]
    iterators = [iter(loader) for loader in world2]
    for it in iterators:
        _take(it, taken)
    state = world2[0].state_dict()
    stayed = [[b[0].tolist() for b in it] for it in iterators]  # the rest of the epoch at world 2
    shrunk = resumable_loader(dataset, batch, SimpleNamespace(world_size=1, global_rank=0), seed=3)
    shrunk.load_state_dict(state)
    micro = [b[0].tolist() for b in shrunk]
    assert len(micro) == 2 * len(stayed[0]) == 2 * (40 // 2 // batch - taken)
    for step, (rank0, rank1) in enumerate(zip(*stayed, strict=True)):
        assert micro[2 * step] + micro[2 * step + 1] == [i for pair in zip(rank0, rank1, strict=True) for i in pair]
    fresh = resumable_loader(dataset, batch, SimpleNamespace(world_size=1, global_rank=0), seed=3)
    list(fresh)  # its epoch 0
    assert [b[0].tolist() for b in shrunk] == [b[0].tolist() for b in fresh]

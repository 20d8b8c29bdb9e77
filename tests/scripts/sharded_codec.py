"""Two gloo ranks with an FSDP2 model and Adam: the sharded checkpoint goes through a snapshot
(each rank its own shards) and comes back into the live shards and the optimizer.

Run by tests/test_checkpoint_sharded.py: ``python sharded_codec.py ROOT``; prints ``OK <rank>``."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_ft.checkpoint import SnapshotStore
from lightning_ft.checkpoint.sharded import (
    ShardLayoutError,
    copy_into_shards,
    count_shards,
    dtensors_to_shards,
    shards_to_dtensors,
)

SHARDED = StateDictOptions(full_state_dict=False, cpu_offload=True)


def build(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model, optimizer, steps: int) -> None:
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def run(rank: int, root: str, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
    model = build(mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optimizer, 3)

    checkpoint = {"state_dict": get_model_state_dict(model, options=SHARDED),
                  "optimizer_states": [get_optimizer_state_dict(model, optimizer, options=SHARDED)],
                  "global_step": 3}
    encoded = dtensors_to_shards(checkpoint)
    # 2 Linear layers: 4 parameters, each with 2 Adam moments
    assert count_shards(encoded) == 4 + 8, count_shards(encoded)
    weight = encoded["state_dict"]["0.weight"]
    assert weight["global_shape"] == [16, 8] and weight["placements"] == ["S0"] and weight["mesh_shape"] == [2]
    assert tuple(weight["local"].shape) == (8, 8) and weight["coordinate"] == [rank]

    with SnapshotStore(root=root, run_id="sharded", rank=rank) as snapshots:
        snapshots.save(encoded, step=3)
        loaded = snapshots.load()

    # what training did afterwards is undone by the restore
    expected = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    expected_moments = {k: v["exp_avg"].to_local().clone()
                        for k, v in get_optimizer_state_dict(model, optimizer, options=SHARDED)["state"].items()}
    train(model, optimizer, 2)
    assert not torch.equal(model.state_dict()["0.weight"].to_local(), expected["0.weight"])

    copied = copy_into_shards(model.state_dict(), loaded["state_dict"])
    assert sorted(copied) == sorted(expected), copied
    for key, value in model.state_dict().items():
        assert torch.equal(value.to_local(), expected[key]), key
    set_optimizer_state_dict(model, optimizer, shards_to_dtensors(loaded["optimizer_states"][0], mesh),
                             options=SHARDED)
    for key, value in get_optimizer_state_dict(model, optimizer, options=SHARDED)["state"].items():
        assert torch.equal(value["exp_avg"].to_local(), expected_moments[key]), key

    # a snapshot of another world size is refused, naming both
    other = dict(loaded["state_dict"]["0.weight"], mesh_shape=[4])
    try:
        copy_into_shards(model.state_dict(), {"0.weight": other})
    except ShardLayoutError as exc:
        assert "world size 4" in str(exc) and "world size 2" in str(exc), exc
    else:
        raise AssertionError("a shard of another world size was accepted")
    # and a rank's shard is not another rank's
    swapped = dict(loaded["state_dict"]["0.weight"], coordinate=[1 - rank])
    try:
        copy_into_shards(model.state_dict(), {"0.weight": swapped})
    except ShardLayoutError as exc:
        assert "its own shard" in str(exc), exc
    else:
        raise AssertionError("another rank's shard was accepted")
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(run, args=(sys.argv[1], free), nprocs=2, start_method="fork")

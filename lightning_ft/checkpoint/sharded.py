"""Sharded state (FSDP2 / DTensor) in a snapshot: each rank keeps only its own shards.

A checkpoint of a sharded model holds ``DTensor`` values (weights and optimizer moments). A
snapshot stores each as a :class:`LocalShard` record of plain values -- the rank's local tensor,
the global shape, the placements and the mesh's shape -- so the restricted loader never needs to
know ``DTensor``, and nothing is gathered to one rank. Restoring turns the records back into
``DTensor`` values on the current device mesh (:func:`shards_to_dtensors`), or copies them into
the live shards (:func:`copy_into_shards`).

A snapshot of one world size cannot be restored at another: the shards would not line up.
Resharding is not supported; :class:`ShardLayoutError` names the saved and the current layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

#: the key that marks a dict as a :class:`LocalShard` record in a snapshot
SHARD_MARK = "__lightning_ft_shard__"


class ShardLayoutError(RuntimeError):
    """A saved shard does not fit the current sharding (another world size, shape or placement)."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no sharded state either
        return None
    return DTensor


def encode_placements(placements: Any) -> list[str]:
    """``Shard(d)`` -> ``"S<d>"``, ``Replicate()`` -> ``"R"``; anything else is refused (a pending
    reduction is not state)."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for placement in placements:
        if isinstance(placement, Shard):
            out.append(f"S{placement.dim}")
        elif isinstance(placement, Replicate):
            out.append("R")
        else:
            raise ShardLayoutError(f"cannot snapshot a DTensor placed as {placement!r} (only Shard and Replicate)")
    return out


def decode_placements(codes: list[str]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    placements: list[Any] = []
    for code in codes:
        if code == "R":
            placements.append(Replicate())
        elif code.startswith("S") and code[1:].isdigit():
            placements.append(Shard(int(code[1:])))
        else:
            raise ShardLayoutError(f"unknown placement {code!r} in a snapshot")
    return placements


def local_shard_record(tensor: Any) -> dict[str, Any]:
    """The plain record of one ``DTensor`` (its local shard on this rank, detached, on the CPU)."""
    mesh = tensor.device_mesh
    return {SHARD_MARK: 1, "local": tensor.to_local().detach().cpu(), "global_shape": list(tensor.shape),
            "placements": encode_placements(tensor.placements), "mesh_shape": list(mesh.shape),
            "coordinate": list(mesh.get_coordinate() or [])}


def is_shard_record(value: Any) -> bool:
    return isinstance(value, dict) and value.get(SHARD_MARK) == 1


def _map(obj: Any, leaf: Callable[[Any], Any | None]) -> Any:
    """``obj`` with every value ``leaf`` answers (not None) replaced; containers rebuilt only when
    something inside changed (dicts keep their type: OrderedDict stays one)."""
    replaced = leaf(obj)
    if replaced is not None:
        return replaced
    if isinstance(obj, dict):
        items = {key: _map(value, leaf) for key, value in obj.items()}
        if all(items[key] is obj[key] for key in obj):
            return obj
        out = type(obj)() if type(obj) is not dict else {}
        try:
            out.update(items)
        except TypeError:  # a dict subclass that cannot be built empty
            return items
        return out
    if isinstance(obj, list):
        values = [_map(value, leaf) for value in obj]
        return obj if all(a is b for a, b in zip(values, obj, strict=True)) else values
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):  # named tuples are left alone
        values = [_map(value, leaf) for value in obj]
        return obj if all(a is b for a, b in zip(values, obj, strict=True)) else tuple(values)
    return obj


def dtensors_to_shards(checkpoint: Any) -> Any:
    """``checkpoint`` with every ``DTensor`` replaced by its :func:`local_shard_record` (the rest is
    shared, not copied). Without DTensors it is returned as it is."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return checkpoint
    return _map(checkpoint, lambda value: local_shard_record(value) if isinstance(value, dtensor) else None)


def count_shards(checkpoint: Any) -> int:
    """How many :class:`LocalShard` records ``checkpoint`` holds."""
    found = 0

    def leaf(value: Any) -> None:
        nonlocal found
        if is_shard_record(value):
            found += 1
        return None

    _map(checkpoint, leaf)
    return found


def _check_layout(record: dict[str, Any], mesh: Any, where: str) -> None:
    saved = list(record.get("mesh_shape", []))
    now = list(mesh.shape)
    if saved != now:
        raise ShardLayoutError(
            f"{where}: the snapshot was taken with a device mesh of shape {saved} (world size "
            f"{math.prod(saved)}) and this run has {now} (world size {math.prod(now)}): sharded state "
            "cannot be restored at another world size (resharding is not supported); resume with "
            f"{math.prod(saved)} active participants or start from a full checkpoint")
    coordinate = list(mesh.get_coordinate() or [])
    if list(record.get("coordinate", [])) != coordinate:
        raise ShardLayoutError(f"{where}: the snapshot holds the shard of mesh coordinate {record.get('coordinate')} "
                               f"and this rank is {coordinate}: a rank must restore its own shard")


def shards_to_dtensors(checkpoint: Any, mesh: Any, where: str = "snapshot") -> Any:
    """``checkpoint`` with every shard record turned back into a ``DTensor`` on ``mesh`` (this
    rank's local shard, the saved global shape and placements). :class:`ShardLayoutError` when a
    record was taken with another mesh shape or by another rank's coordinate."""
    from torch.distributed.tensor import DTensor

    def leaf(value: Any) -> Any | None:
        if not is_shard_record(value):
            return None
        _check_layout(value, mesh, where)
        shape = torch.Size(value["global_shape"])
        return DTensor.from_local(value["local"], mesh, decode_placements(value["placements"]), run_check=False,
                                  shape=shape, stride=_contiguous_stride(shape))

    return _map(checkpoint, leaf)


def optimizer_shards_to_dtensors(state: dict[str, Any], meshes: dict[str, Any], where: str = "snapshot") -> Any:
    """A sharded optimizer state dict (``get_optimizer_state_dict``: ``state`` keyed by parameter
    name) with its shard records turned back into ``DTensor``s, each on the mesh of its
    parameter (``meshes``: parameter name -> device mesh)."""
    per_param = state.get("state", {})
    restored = {}
    for name, values in per_param.items():
        mesh = meshes.get(name)
        if mesh is None:
            if count_shards(values):
                raise ShardLayoutError(f"{where}: optimizer state of {name!r} is sharded, but the model has no "
                                       "sharded parameter of that name")
            restored[name] = values
        else:
            restored[name] = shards_to_dtensors(values, mesh, f"{where}: optimizer state of {name}")
    return {**state, "state": restored}


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def copy_into_shards(state_dict: dict[str, Any], saved: dict[str, Any], where: str = "snapshot") -> list[str]:
    """Copy saved shard records into the live ``DTensor`` (or plain tensor) values of ``state_dict``
    in place (``to_local().copy_()``: the module keeps its parameters). Returns the keys copied;
    :class:`ShardLayoutError` when a key's shape or layout differs."""
    dtensor = _dtensor_type()
    copied = []
    for key, target in state_dict.items():
        if key not in saved:
            continue
        value = saved[key]
        if dtensor is not None and isinstance(target, dtensor):
            target = cast(Any, target)  # a DTensor (the checker cannot narrow to a type held in a variable)
            if not is_shard_record(value):
                raise ShardLayoutError(f"{where}: {key} is sharded now but was saved whole")
            _check_layout(value, target.device_mesh, f"{where}: {key}")
            if list(value["global_shape"]) != list(target.shape) or \
                    value["placements"] != encode_placements(target.placements):
                raise ShardLayoutError(f"{where}: {key} was saved as {value['global_shape']} placed "
                                       f"{value['placements']}, the model has {list(target.shape)} placed "
                                       f"{encode_placements(target.placements)}")
            local = target.to_local()
            if local.shape != value["local"].shape:
                raise ShardLayoutError(f"{where}: {key}: local shard {tuple(value['local'].shape)} saved, "
                                       f"{tuple(local.shape)} here")
            with torch.no_grad():
                local.copy_(value["local"])
        elif isinstance(target, torch.Tensor):
            if is_shard_record(value):
                raise ShardLayoutError(f"{where}: {key} was saved sharded but is whole in this model")
            with torch.no_grad():
                target.copy_(value)
        else:
            continue
        copied.append(key)
    return copied

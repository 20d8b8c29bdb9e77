"""Hyperparameters as plain data, so that a snapshot holds what users' configs hold in practice.

Lightning puts a module's (and a datamodule's) saved hyperparameters into every checkpoint. What
users pass there is often not plain data: Hydra/OmegaConf ``DictConfig``/``ListConfig``,
dataclass configs, ``Enum`` members, ``pathlib`` paths, ``argparse.Namespace``. A snapshot is
decoded by an allow-list unpickler that constructs none of those (a snapshot file crosses hosts
and must not run code when it is read), so they are stored as the plain data they describe:

* OmegaConf containers -> their dicts and lists (interpolations left unresolved, as written);
* a dataclass instance -> a dict of its fields; an ``argparse.Namespace`` -> a dict;
* an ``Enum`` member -> its value; a path (``os.PathLike``) -> its string;
* mappings, lists, tuples and sets -> the same kind, their items converted;
* the class Lightning records for an OmegaConf container (``hparams_type``) -> its qualified name,
  which Lightning's ``load_from_checkpoint`` reads as "a dict of hyperparameters".

Nothing else changes: a resumed run gets its hyperparameters from its own ``__init__`` (Lightning
never restores ``hparams`` from a checkpoint it resumes), so only the record inside the snapshot
is plain. Anything else that the loader would refuse is still refused at the save, naming where.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import Any

#: the checkpoint entries that hold saved hyperparameters (Lightning's names)
HYPERPARAMETER_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
#: the entries Lightning records an OmegaConf container's class in (a global the loader would
#: have to construct): kept as its qualified name, which Lightning's loading reads as a dict
HYPERPARAMETER_TYPE_KEYS = ("hparams_type", "datamodule_hparams_type")
_MAX_DEPTH = 64


def with_plain_hyperparameters(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its hyperparameter entries as plain data (the other entries as they are)."""
    if not any(key in checkpoint for key in (*HYPERPARAMETER_KEYS, *HYPERPARAMETER_TYPE_KEYS)):
        return checkpoint
    return {key: plain_data(value) if key in HYPERPARAMETER_KEYS else _type_name(value)
            if key in HYPERPARAMETER_TYPE_KEYS else value for key, value in checkpoint.items()}


def _type_name(value: Any) -> Any:
    return f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else value


def plain_data(value: Any, depth: int = 0) -> Any:
    """``value`` with OmegaConf containers, dataclasses, namespaces, enums and paths as plain data."""
    if depth > _MAX_DEPTH or value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    container = _omegaconf_container(value)
    if container is not None:
        return plain_data(container, depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if isinstance(value, argparse.Namespace):
        return {key: plain_data(item, depth + 1) for key, item in vars(value).items()}
    if isinstance(value, enum.Enum):
        return plain_data(value.value, depth + 1)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {plain_data(key, depth + 1): plain_data(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_data(item, depth + 1) for item in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, (set, frozenset)):
        return {plain_data(item, depth + 1) for item in value}
    return value


def _omegaconf_container(value: Any) -> Any:
    """The plain container of an OmegaConf ``DictConfig``/``ListConfig`` (None for anything else);
    omegaconf is imported only when a value comes from it."""
    if not type(value).__module__.startswith("omegaconf"):
        return None
    from omegaconf import Container, OmegaConf  # optional: Hydra users have it

    return OmegaConf.to_container(value, resolve=False) if isinstance(value, Container) else None

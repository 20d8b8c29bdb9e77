"""Where the ``ddp_ft`` strategy's settings come from, checked before anything starts.

Explicit constructor arguments, else ``LIGHTNING_FT_ENDPOINT`` / ``LIGHTNING_FT_RUN_ID`` /
``LIGHTNING_FT_NNODES``; under ``torchrun`` (``TORCHELASTIC_RUN_ID`` set) torchrun's agent
owns the rendezvous and these settings must not be given. Every error names the setting.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from lightning_ft.rendezvous.handler import parse_endpoint
from lightning_ft.rendezvous.settings import RendezvousConfigError
from lightning_ft.strategy.decisions import merge_setting, parse_nnodes

ENV_ENDPOINT = "LIGHTNING_FT_ENDPOINT"
ENV_RUN_ID = "LIGHTNING_FT_RUN_ID"
ENV_NNODES = "LIGHTNING_FT_NNODES"
ENV_DOMAIN_ID = "LIGHTNING_FT_DOMAIN_ID"
ENV_TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"


class StrategyConfigError(ValueError):
    """A ``ddp_ft`` setting is missing, invalid or contradicts another; the message names it."""


class LaunchMode(enum.Enum):
    #: the strategy runs the barrier rendezvous itself (srun, JobSet, plain ``python``)
    RENDEZVOUS = "rendezvous"
    #: torchrun's elastic agent did the rendezvous and restarts workers
    TORCHELASTIC = "torchelastic"


@dataclass(frozen=True)
class LaunchConfig:
    mode: LaunchMode
    run_id: str
    host: str | None = None
    port: int | None = None
    min_nodes: int | None = None
    max_nodes: int | None = None

    @property
    def endpoint(self) -> str | None:
        return None if self.host is None else f"{self.host}:{self.port}"


def resolve_launch_config(endpoint: str | None, run_id: str | None, min_nodes: int | None,
                          max_nodes: int | None, env: Mapping[str, str] | None = None) -> LaunchConfig:
    """Combine arguments and environment into one launch configuration, or raise StrategyConfigError."""
    env = os.environ if env is None else env
    elastic_run_id = env.get(ENV_TORCHELASTIC_RUN_ID)
    if elastic_run_id:
        return _torchelastic_config(endpoint, run_id, min_nodes, max_nodes, env, elastic_run_id)
    try:
        endpoint_text = merge_setting("endpoint", endpoint, ENV_ENDPOINT, env.get(ENV_ENDPOINT))
        run_id_value = merge_setting("run_id", run_id, ENV_RUN_ID, env.get(ENV_RUN_ID))
        nodes = _merge_nodes(min_nodes, max_nodes, env.get(ENV_NNODES))
    except ValueError as exc:
        raise StrategyConfigError(f"ddp_ft: {exc}") from None
    missing = []
    if endpoint_text is None:
        missing.append(f"endpoint= (or {ENV_ENDPOINT}=HOST:PORT)")
    if run_id_value is None:
        missing.append(f"run_id= (or {ENV_RUN_ID})")
    if nodes is None:
        missing.append(f"min_nodes=/max_nodes= (or {ENV_NNODES}=MIN:MAX)")
    if missing:
        raise StrategyConfigError("ddp_ft: missing setting(s): " + "; ".join(missing) +
                                  ". Or launch with torchrun --rdzv-backend=lightning_ft.")
    try:
        host, port = parse_endpoint(str(endpoint_text))
    except RendezvousConfigError as exc:
        raise StrategyConfigError(f"ddp_ft: endpoint {endpoint_text!r}: {exc}") from None
    run_id_text = str(run_id_value)
    if not run_id_text or "/" in run_id_text:
        raise StrategyConfigError(f"ddp_ft: run_id must be a non-empty string without '/', got {run_id_text!r}")
    return LaunchConfig(LaunchMode.RENDEZVOUS, run_id_text, host, port, nodes[0], nodes[1])


def _merge_nodes(min_nodes: int | None, max_nodes: int | None, env_nnodes: str | None) -> tuple[int, int] | None:
    for name, value in (("min_nodes", min_nodes), ("max_nodes", max_nodes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_nodes is not None and min_nodes is None:
        raise ValueError("max_nodes is set but min_nodes is not; pass both (or LIGHTNING_FT_NNODES=MIN:MAX)")
    explicit = None
    if min_nodes is not None:
        explicit = (min_nodes, min_nodes if max_nodes is None else max_nodes)
        if explicit[1] < explicit[0]:
            raise ValueError(f"min_nodes={min_nodes} must not exceed max_nodes={max_nodes}")
    from_env = parse_nnodes(env_nnodes, ENV_NNODES) if env_nnodes not in (None, "") else None
    if explicit is not None and from_env is not None and explicit != from_env:
        raise ValueError(f"contradictory settings: min_nodes/max_nodes={explicit[0]}:{explicit[1]} but "
                         f"{ENV_NNODES}={env_nnodes!r}; set one of them")
    return explicit or from_env


def _torchelastic_config(endpoint, run_id, min_nodes, max_nodes, env, elastic_run_id) -> LaunchConfig:
    conflicts = []
    if endpoint is not None:
        conflicts.append("endpoint=")
    if env.get(ENV_ENDPOINT):
        conflicts.append(ENV_ENDPOINT)
    if min_nodes is not None or max_nodes is not None:
        conflicts.append("min_nodes=/max_nodes=")
    if env.get(ENV_NNODES):
        conflicts.append(ENV_NNODES)
    if conflicts:
        raise StrategyConfigError(
            f"ddp_ft: contradictory settings: this process was started by torchrun ({ENV_TORCHELASTIC_RUN_ID}="
            f"{elastic_run_id!r}), whose agent does the rendezvous (--rdzv-endpoint, --nnodes), but "
            f"{', '.join(conflicts)} {'is' if len(conflicts) == 1 else 'are'} set too; remove "
            f"{'it' if len(conflicts) == 1 else 'them'}, or launch without torchrun")
    for name, value in (("run_id", run_id), (ENV_RUN_ID, env.get(ENV_RUN_ID))):
        if value not in (None, "") and value != elastic_run_id:
            raise StrategyConfigError(
                f"ddp_ft: contradictory settings: {name}={value!r} but torchrun's --rdzv-id is "
                f"{elastic_run_id!r}; drop {name} or make them equal")
    return LaunchConfig(LaunchMode.TORCHELASTIC, elastic_run_id)


def check_positive(name: str, value: Any, *, integer: bool = False, allow_none: bool = False,
                   allow_zero: bool = False) -> None:
    """Raise StrategyConfigError naming ``name`` unless ``value`` is a positive (or zero) number."""
    if value is None and allow_none:
        return
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and not integer:
        ok = math.isfinite(value)
    if ok:
        ok = value >= 0 if allow_zero else value > 0
    if not ok:
        what = "an integer" if integer else "a number"
        bound = ">= 0" if allow_zero else "> 0"
        raise StrategyConfigError(f"ddp_ft: {name} must be {what} {bound}"
                                  f"{' or None' if allow_none else ''}, got {value!r}")

"""Keep Lightning's SLURM detection from rejecting ``Trainer(strategy="ddp_ft")`` under ``srun``.

Everything lightning_ft knows about this Lightning internal lives in this module.

Why (Lightning 2.6, ``lightning/pytorch/trainer/connectors/accelerator_connector.py``):
``_AcceleratorConnector.__init__`` picks the cluster environment (its step 3,
``_choose_and_init_cluster_environment``) *before* it instantiates a strategy given by name
(step 4). Inside an srun task that auto-detection chooses ``SLURMEnvironment``, and its
constructor validates srun's variables: ``#SBATCH --ntasks=3`` without ``--ntasks-per-node``
raises "You set `--ntasks=3` in your SLURM bash script, but this variable is not supported",
and later checks compare ``--ntasks-per-node``/``--nodes`` with ``devices``/``num_nodes``.
One participant per task, in whatever layout, is exactly what ddp_ft wants, and ddp_ft never
uses that environment: ``FaultTolerantDDPStrategy`` brings its own (ranks from the rendezvous
round, or from torchrun), which replaces the detected one in step 6 (``_lazy_init_strategy``).
A strategy *instance* was never affected: Lightning takes its environment before detecting.

So when the strategy is given by a name registered for one of ours (the class, a subclass, or
a factory function registered in its place) and no cluster environment plugin was passed,
detection is skipped and Lightning gets a placeholder ``LightningEnvironment`` (its
constructor has no side effects), which the strategy's own environment then replaces. Every
other strategy goes through Lightning's detection unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

log = logging.getLogger(__name__)

_OWN_FACTORIES: list[Callable[..., Any]] = []
_WRAPPED_MARK = "_lightning_ft_original"


def skips_cluster_detection(strategy_flag: Any, cluster_environment_flag: Any, registry: dict[str, Any],
                            own_factories: Sequence[Callable[..., Any]]) -> bool:
    """True when Lightning's cluster-environment detection must not run for this Trainer.

    ``strategy_flag`` is the Trainer's strategy argument as the connector holds it (a name or
    an instance), ``cluster_environment_flag`` a cluster environment passed as a plugin (or
    None), ``registry`` Lightning's ``StrategyRegistry`` (name -> {"strategy": class or
    factory, ...}), ``own_factories`` what lightning_ft registers (classes match subclasses).
    """
    if not isinstance(strategy_flag, str) or cluster_environment_flag is not None:
        return False  # an instance brings its environment; a plugin is used as given
    entry = dict.get(registry, strategy_flag)  # StrategyRegistry.get() would instantiate the strategy
    registered = entry.get("strategy") if isinstance(entry, Mapping) else None
    if registered is None:
        return False
    return any(registered is own or (isinstance(registered, type) and isinstance(own, type)
                                     and issubclass(registered, own)) for own in own_factories)


def install(strategy_factory: Callable[..., Any]) -> None:
    """Skip Lightning's cluster detection when a name registered for ``strategy_factory`` (a
    strategy class, which covers its subclasses, or a factory function) is chosen (idempotent)."""
    if strategy_factory not in _OWN_FACTORIES:
        _OWN_FACTORIES.append(strategy_factory)
    try:
        from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    except ImportError as exc:  # pragma: no cover - another Lightning layout: nothing to patch
        log.debug("lightning_ft: Lightning's accelerator connector not found (%s); SLURM detection unchanged", exc)
        return
    original = getattr(_AcceleratorConnector, "_choose_and_init_cluster_environment", None)
    if original is None:  # pragma: no cover - a Lightning version without this step
        log.debug("lightning_ft: no _choose_and_init_cluster_environment in this Lightning; nothing patched")
        return
    if hasattr(original, _WRAPPED_MARK):
        return

    def _choose_and_init_cluster_environment(self: _AcceleratorConnector) -> ClusterEnvironment:
        from lightning.fabric.plugins.environments import LightningEnvironment
        from lightning.pytorch.strategies import StrategyRegistry

        if skips_cluster_detection(self._strategy_flag, self._cluster_environment_flag, StrategyRegistry,
                                   _OWN_FACTORIES):
            return LightningEnvironment()  # placeholder: replaced by the strategy's own environment
        return original(self)

    setattr(_choose_and_init_cluster_environment, _WRAPPED_MARK, original)
    # the patch this module exists for
    _AcceleratorConnector._choose_and_init_cluster_environment = _choose_and_init_cluster_environment  # type: ignore[method-assign]

"""The state a fresh process would start ``fit()`` with, kept so that a recovery can return to it.

A relaunched process re-runs the user's script: it builds the callbacks, loggers, datamodule
and LightningModule anew and then resumes from a snapshot. A survivor of a failure still
holds everything the failed round left in those objects -- ``ModelCheckpoint``'s
``_last_global_step_saved``, ``SaveConfigCallback.already_saved``, a torchmetrics state half
way through a validation, a user attribute -- which a spare that joins does not have; the two
then enter different collectives and deadlock. :class:`PristineState` copies these objects
when ``fit()`` starts (before anything ran) and puts the copies back *in place* after a
failure, on every participant alike, so that survivors and spares take the same code path.

In place: each object's ``__dict__`` is replaced by a deep copy of the pristine one, so the
references the user holds (``model``, ``checkpoint_callback.best_model_path`` after
``fit()``) stay valid. The LightningModule's parameters and buffers are shared with the copy,
not copied (their values come from the snapshot), which keeps the cost at about a millisecond
whatever the model size. Objects that cannot be deep-copied (locks, threads, open files) are
left as they are and named once in a warning.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_ft._lightning.callbacks import trainer_callbacks
from lightning_ft._logging import StrategyLog

log = logging.getLogger(__name__)
ft_log = StrategyLog(log, {})

# attributes of an nn.Module that hold the tensors and the module tree: shared, never copied
_MODULE_STRUCTURE = ("_parameters", "_buffers", "_modules")


@dataclass
class _Saved:
    target: Any
    state: dict[str, Any]


@dataclass
class PristineState:
    """Deep copies of the user's objects' ``__dict__`` at the start of ``fit()``."""

    objects: list[_Saved] = field(default_factory=list)
    #: (parameter, requires_grad) as fit() received them
    requires_grad: list[tuple[nn.Parameter, bool]] = field(default_factory=list)
    #: classes that could not be copied (left as they are after a recovery)
    skipped: list[str] = field(default_factory=list)

    @classmethod
    def capture(cls, trainer: pl.Trainer, module: pl.LightningModule | None, datamodule: Any,
                keep: tuple[type, ...]) -> PristineState:
        """Copy the callbacks (except instances of ``keep``), loggers, datamodule and module."""
        state = cls()
        targets: list[Any] = [cb for cb in trainer_callbacks(trainer) if not isinstance(cb, keep)]
        targets += list(trainer.loggers)
        if datamodule is not None:
            targets.append(datamodule)
        memo = _shared_memo(trainer, module, targets)
        for target in targets:
            state._save(target, dict(vars(target)), memo)
        if module is not None:
            for submodule in module.modules():
                own = {k: v for k, v in vars(submodule).items() if k not in _MODULE_STRUCTURE}
                state._save(submodule, own, memo)
            state.requires_grad = [(p, p.requires_grad) for p in module.parameters()]
        if state.skipped:
            ft_log.warning("cannot copy %s at fit() start (%s); after a recovery they keep the state the "
                        "failed round left", ", ".join(sorted(set(state.skipped))),
                        "they hold locks, threads or open files")
        return state

    def _save(self, target: Any, state: dict[str, Any], memo: dict[int, Any]) -> None:
        try:
            copied = copy.deepcopy(state, dict(memo))
        except Exception as exc:  # noqa: BLE001 - an uncopyable object stays as it is
            ft_log.debug("%s not copied: %s: %s", type(target).__name__, type(exc).__name__, exc)
            self.skipped.append(type(target).__name__)
            return
        self.objects.append(_Saved(target, copied))

    def restore(self, trainer: pl.Trainer, module: pl.LightningModule | None) -> None:
        """Put every copied object back into its pristine state (the copies stay pristine)."""
        memo = _shared_memo(trainer, module, [saved.target for saved in self.objects])
        for saved in self.objects:
            fresh = copy.deepcopy(saved.state, dict(memo))
            target_dict = vars(saved.target)
            structure = {k: target_dict[k] for k in _MODULE_STRUCTURE if k in target_dict} \
                if isinstance(saved.target, nn.Module) else {}
            target_dict.clear()
            target_dict.update(fresh)
            target_dict.update(structure)
        for parameter, requires_grad in self.requires_grad:
            parameter.requires_grad_(requires_grad)
            parameter.grad = None  # a fresh process has none; the snapshot restores the values


def _shared_memo(trainer: pl.Trainer, module: pl.LightningModule | None, targets: list[Any]) -> dict[int, Any]:
    """What the copies share with the live objects instead of copying: the Trainer and its
    strategy, every object copied on its own (a callback that refers to another refers to the
    live one), the module tree and every tensor of it (their values come from the snapshot)."""
    memo: dict[int, Any] = {id(trainer): trainer, id(trainer.strategy): trainer.strategy}
    for target in (*trainer_callbacks(trainer), *trainer.loggers, *targets):
        memo[id(target)] = target
    if module is not None:
        for submodule in module.modules():
            memo[id(submodule)] = submodule
        for tensor in (*module.parameters(), *module.buffers()):
            memo[id(tensor)] = tensor
    return memo

"""The LightningModule's submodules as ``fit()`` received them, so sharded state can be rebuilt.

FSDP2's ``fully_shard`` turns a module into a sharded one in place: it swaps the module's
class, replaces its parameters with ``DTensor`` parameters bound to the device mesh's process
groups and registers the module with torch's composable-API state (a second ``fully_shard``
of the same object is refused). After a failed round that mesh is dead, and the user's
``configure_model`` -- guarded, as Lightning asks, by "already sharded? return" -- would leave
the module on it. A relaunched process instead builds the module anew and shards it on the new
mesh; :class:`ModuleTemplate` does the same inside the process: at ``fit()`` start it keeps a
copy of each direct child of the LightningModule with its parameters on the ``meta`` device
(no memory for their values; buffers are copied, they are small and not always in the state
dict), and after a failure puts fresh copies in place of the sharded children. Their
parameters are allocated but not initialized: the snapshot the next round resumes from gives
every parameter its value, exactly as it does in a relaunched process.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` itself."""
    fsdp = _fsdp_module_class()
    return fsdp is not None and isinstance(module, fsdp)


@dataclass
class ModuleTemplate:
    """Meta-device copies of a LightningModule's direct children, taken before ``configure_model``."""

    children: dict[str, nn.Module]
    #: why the module cannot be rebuilt (None: it can)
    problem: str | None = None

    @classmethod
    def capture(cls, module: nn.Module) -> ModuleTemplate:
        """Copy ``module``'s direct children with their parameters on the meta device."""
        sharded = [name for name, sub in module.named_modules() if is_sharded(sub)]
        if sharded:
            return cls({}, f"submodule(s) {', '.join(n or '<root>' for n in sharded[:3])} were already sharded "
                           "when fit() started (shard them in configure_model, as ModelParallelStrategy asks)")
        children = {name: _to_meta(child) for name, child in module.named_children()}
        return cls(children)

    def rebuild_problem(self, module: nn.Module) -> str | None:
        """Why :meth:`rebuild` cannot return ``module`` to its state at ``fit()`` start (None: it can)."""
        if self.problem is not None:
            return self.problem
        if is_sharded(module):
            return (f"the LightningModule {type(module).__name__} itself was sharded (fully_shard(self)); fsdp_ft "
                    "can rebuild only its submodules: shard those, e.g. fully_shard(self.model)")
        if set(dict(module.named_children())) != set(self.children):
            return "the LightningModule's submodules changed during fit() (added or removed attributes)"
        return None

    def rebuild(self, module: nn.Module, device: torch.device) -> None:
        """Put fresh, unsharded copies of the children in place (parameters allocated on
        ``device``, values to come from a snapshot; buffers as at ``fit()`` start)."""
        problem = self.rebuild_problem(module)
        if problem is not None:
            raise RuntimeError(f"fsdp_ft: cannot rebuild the module: {problem}")
        for name, template in self.children.items():
            setattr(module, name, _materialize(template, device))


def _to_meta(child: nn.Module) -> nn.Module:
    """A deep copy of ``child`` whose parameters live on the meta device (tied ones stay tied)."""
    memo: dict[int, object] = {}
    for parameter in child.parameters():
        memo[id(parameter)] = nn.Parameter(parameter.detach().to("meta"), requires_grad=parameter.requires_grad)
    return copy.deepcopy(child, memo)


def _materialize(template: nn.Module, device: torch.device) -> nn.Module:
    """A deep copy of ``template`` with every meta parameter allocated (uninitialized) on ``device``."""
    memo: dict[int, object] = {}
    for parameter in template.parameters():
        memo[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device=device),
                                           requires_grad=parameter.requires_grad)
    return copy.deepcopy(template, memo)

"""The state a snapshot at the end of optimizer step ``s`` holds, kept up to date cheaply while step
``s+1`` runs: the part of Lightning's checkpoint that step ``s+1`` changes before its update.

In Lightning's automatic optimization, forward, backward (DDP's gradient all-reduce) and clipping
run inside ``optimizer.step(closure)`` before any update, so a collective that fails in step
``s+1`` leaves the parameters, the optimizer state, step-wise schedulers and the precision
plugin's scaler at ``s``. What is *not* at ``s`` by then: the loops' progress counters (step
``s+1`` is under way), the train loader's position (the next batch was fetched), and module
buffers that forward updates in place (BatchNorm's running statistics). :class:`BoundaryRecorder`
copies those three at every optimizer-step boundary -- about 30 small dict copies and one
``_foreach_copy_`` of the persistent buffers (the loader's state only when it is stateful) --
and :meth:`BoundaryRecorder.checkpoint_at_boundary` puts them back and dumps the checkpoint:
the live tensors plus that capture are the snapshot of step ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress


@dataclass
class StepBoundary:
    """What :class:`BoundaryRecorder` captured at the end of optimizer step ``step``."""

    step: int
    progress: list[tuple[_BaseProgress, dict[str, Any]]]
    batches_that_stepped: int
    loader_states: list[dict[str, Any]] | None


def _progress_objects(loop: _Loop) -> list[_BaseProgress]:
    """Every progress object of ``loop`` and its child loops, nested ones included (each is restored
    from a copy of its own ``__dict__``; a parent's copy refers to the same children)."""
    found: list[_BaseProgress] = []

    def collect(progress: _BaseProgress) -> None:
        found.append(progress)
        for value in vars(progress).values():
            if isinstance(value, _BaseProgress):
                collect(value)

    for value in vars(loop).values():
        if isinstance(value, _BaseProgress):
            collect(value)
        elif isinstance(value, _Loop):
            found.extend(_progress_objects(value))
    return found


def _persistent_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's buffers that its state dict holds (non-persistent ones are not checkpointed)."""
    buffers = []
    for _, submodule in module.named_modules():
        for name, buffer in submodule.named_buffers(prefix="", recurse=False):
            if buffer is not None and name not in submodule._non_persistent_buffers_set:
                buffers.append(buffer)
    return list({id(b): b for b in buffers}.values())  # a buffer shared by two modules once


def _stateful_loaders(trainer: Any) -> bool:
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    flattened = getattr(combined, "flattened", None) or []
    return any(callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
               for loader in flattened)


class BoundaryRecorder:
    """Captures the step-boundary state of one run of ``fit`` (build it when training starts: the
    loops, the loader and the module's buffers must be those of this run)."""

    def __init__(self, trainer: Any) -> None:
        self._progress = _progress_objects(trainer.fit_loop)
        self._buffers = _persistent_buffers(trainer.lightning_module)
        self._copies = [torch.empty_like(b) for b in self._buffers]
        self._stateful_loader = _stateful_loaders(trainer)
        #: the newest capture (None before the first boundary of this run)
        self.boundary: StepBoundary | None = None

    def record(self, trainer: Any) -> None:
        """At the end of an optimizer step (``on_train_batch_end`` of the step's last batch)."""
        if self._buffers:
            torch._foreach_copy_(self._copies, self._buffers)
        progress = [(obj, obj.__dict__.copy()) for obj in self._progress]
        fit_loop = trainer.fit_loop
        loaders = fit_loop._combined_loader._state_dicts() if self._stateful_loader else None
        self.boundary = StepBoundary(trainer.global_step, progress, fit_loop.epoch_loop._batches_that_stepped,
                                     loaders)

    def checkpoint_at_boundary(self, trainer: Any) -> dict[str, Any]:
        """Lightning's checkpoint of the boundary's step, from the live parameters and optimizer
        state (the caller proved they were not updated since) and the captured rest. Puts the
        capture back into the live loops and buffers and drops the gradients of the interrupted
        step (a partial accumulation window); call it only on the way into a recovery or an exit."""
        boundary = self.boundary
        assert boundary is not None
        for obj, values in boundary.progress:
            obj.__dict__.update(values)
        trainer.fit_loop.epoch_loop._batches_that_stepped = boundary.batches_that_stepped
        with torch.no_grad():
            for buffer, copy in zip(self._buffers, self._copies, strict=True):
                buffer.copy_(copy)
        for parameter in trainer.lightning_module.parameters():
            parameter.grad = None
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if boundary.loader_states is not None:
            loops = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
            if isinstance(loops, dict):
                loops["combined_loader"] = boundary.loader_states
        return checkpoint

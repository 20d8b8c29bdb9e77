"""The typed callback lookup: which of our callbacks a Trainer has."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


def trainer_callbacks(trainer: Any) -> list[Any]:
    """``trainer.callbacks``: set by Lightning's callback connector, so unknown to the Trainer's type."""
    callbacks: list[Any] = trainer.callbacks
    return callbacks


def callbacks_of_type(trainer: Any, cls: type[T]) -> list[T]:
    """Every callback of ``trainer`` that is an instance of ``cls`` (subclasses included), in order."""
    if trainer is None:
        return []
    return [callback for callback in trainer.callbacks if isinstance(callback, cls)]


def first_callback_of_type(trainer: Any, cls: type[T]) -> T | None:
    found = callbacks_of_type(trainer, cls)
    return found[0] if found else None

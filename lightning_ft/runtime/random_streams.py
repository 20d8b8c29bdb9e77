"""Random-number streams a recovery reproduces: each rank's stream is a function of its step.

A recovered rank must draw what the uninterrupted run drew (a Dropout mask in the forward pass):
a survivor that resumes from the step boundary before the failure has drawn the masks of the
failed step already, and a spare that takes a lost rank's place has none of that rank's
generator state. Rather than ship every rank's generators at every step (only the lost rank had
them), each training batch starts from generators seeded with ``derive_seed(base, rank, step,
batch)``: the uninterrupted run, a survivor that redoes the step and a spare that takes rank
``r`` over at ``step`` all draw the same numbers. What is seeded: torch's default generators (CPU
and every CUDA device), Python's ``random`` and, when the program imported it, NumPy's global
state -- what ``seed_everything`` seeds. ``base`` is the user's ``seed_everything`` seed
(``PL_GLOBAL_SEED``), else one derived from the run id: the same on every node and every
relaunch. Generators a program creates itself (``torch.Generator()``) are its own, and so is the
data side: batches are fetched before the hook, and loader workers draw their seeds when an
iterator is made (a recovery makes one mid-epoch).

The price: a model with random layers draws other numbers under ``ddp_ft`` than under ``ddp``
(equal runs with and without faults, not equal to another strategy's); ``random_streams=False``
keeps the generators as they run, and recoveries of such models are then not exact.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
from collections.abc import Mapping

import torch

#: NumPy's legacy seeding takes 32 bits; torch and Python take more, and get the same 32
_SEED_BITS = 32


def base_seed(run_id: str, environ: Mapping[str, str] = os.environ) -> int:
    """The job's base seed: ``seed_everything``'s (``PL_GLOBAL_SEED``), else one from ``run_id``."""
    try:
        return int(environ.get("PL_GLOBAL_SEED", "").strip())
    except ValueError:  # unset, or not a number: the run id's
        pass
    return int.from_bytes(hashlib.blake2b(run_id.encode(), digest_size=8).digest(), "big")


def derive_seed(base: int, rank: int, step: int, batch: int) -> int:
    """The seed of ``rank``'s generators for the training batch ``batch`` of optimizer step
    ``step`` (pure: a hash, so neighbouring ranks and steps get unrelated streams)."""
    text = f"{base}/{rank}/{step}/{batch}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") % (1 << _SEED_BITS)


def seed_generators(seed: int) -> None:
    """Seed every generator ``seed_everything`` seeds (NumPy only when already imported)."""
    torch.manual_seed(seed)  # CPU and every CUDA device
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


class RandomStreams:
    """One process's derived streams (see the module docstring)."""

    def __init__(self, run_id: str) -> None:
        self.base = base_seed(run_id)

    def start_batch(self, rank: int, step: int, batch: int) -> None:
        """Before a training batch's forward pass: ``rank``'s generators for it."""
        seed_generators(derive_seed(self.base, rank, step, batch))

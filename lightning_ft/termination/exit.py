"""The exception that ends a rank at the agreed stop step, with the code the termination decided."""

from __future__ import annotations


class TerminationExit(SystemExit):
    """Raised at the agreed stop step; ``code`` is the process exit code.

    A ``SystemExit`` so that Lightning runs its interrupt handling (``on_exception`` of
    every callback, logger finalization, teardown) and the interpreter then exits with
    ``code`` -- unlike Lightning's ``SIGTERMException``, whose code is ``None`` (exit 0).
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return f"exit {self.code}: {self.message}"

"""Checking user-supplied settings: one set of rules, each caller's own error type and wording.

Every component validates its arguments with these helpers, so "a positive integer" means
the same everywhere (``True`` is not an integer, ``nan`` is not a number) and every message
has the same shape: ``<prefix><name> must be <what>, got <value>``.
"""

from __future__ import annotations

import math
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def number_rule(*, integer: bool = False, minimum: float = 0, inclusive: bool = False,
                allow_none: bool = False) -> str:
    """The wording of a number rule, e.g. ``"an integer > 0 or None"``."""
    kind = "an integer" if integer else "a number"
    return f"{kind} {'>=' if inclusive else '>'} {minimum:g}{' or None' if allow_none else ''}"


def is_number(value: Any, *, integer: bool = False) -> bool:
    """A real int (or finite float unless ``integer``), never a bool."""
    if isinstance(value, bool):
        return False
    if integer:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_number(value: Any, *, integer: bool = False, minimum: float = 0, inclusive: bool = False,
                 allow_none: bool = False) -> bool:
    """Does ``value`` satisfy the rule that :func:`number_rule` words?"""
    if value is None:
        return allow_none
    if not is_number(value, integer=integer):
        return False
    return value >= minimum if inclusive else value > minimum


def require(ok: bool, name: str, expected: str, value: Any, *, error: type[Exception] = ValueError,
            prefix: str = "") -> None:
    """Raise ``error("<prefix><name> must be <expected>, got <value!r>")`` unless ``ok``."""
    if not ok:
        raise error(f"{prefix}{name} must be {expected}, got {value!r}")


def require_number(name: str, value: Any, *, error: type[Exception] = ValueError, prefix: str = "",
                   integer: bool = False, minimum: float = 0, inclusive: bool = False,
                   allow_none: bool = False) -> None:
    """Raise ``error`` naming ``name`` unless ``value`` satisfies the number rule."""
    rule: dict[str, Any] = dict(integer=integer, minimum=minimum, inclusive=inclusive, allow_none=allow_none)
    require(check_number(value, **rule), name, number_rule(**rule), value, error=error, prefix=prefix)


def require_bool(name: str, value: Any, *, error: type[Exception] = ValueError, prefix: str = "") -> None:
    require(isinstance(value, bool), name, "True or False", value, error=error, prefix=prefix)


def parse_bool(name: str, raw: Any, *, error: type[Exception] = ValueError) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case) or a bool -> bool."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise error(f"{name} must be true or false, got {raw!r}")

"""Text from outside -- the store's values, event files -- made safe to print or log."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """``text`` safe for a terminal or a log: control and format characters (ESC and the sequences
    it starts, C1 controls, bidirectional overrides) written as escapes, newlines kept."""
    return "".join(c if c == "\n" or unicodedata.category(c) not in ("Cc", "Cf") else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") for c in text)

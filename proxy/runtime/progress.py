"""Progress on a terminal, for commands that work through many items (``proxy mirror``,
``proxy storage copy``): a bar redrawn in place with ``\\r`` at a fixed width, and labels
made safe to print. No dependency."""

from __future__ import annotations

import shutil
from typing import TextIO

BAR_WIDTH = 24


def printable(text: str) -> str:
    """``text`` with what a terminal should not get escaped (``\\x1b``, ``\\ud800``): a
    label may be a purl from an SBOM, which is anything. A lone surrogate cannot even
    be encoded, and control characters would rewrite the operator's screen."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def redraw(out: TextIO, done: int, total: int, text: str) -> None:
    """Draw ``[####....] done/total  text`` over the terminal's current line."""
    total = max(total, done, 1)
    filled = BAR_WIDTH * done // total
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    line = f"[{bar}] {done}/{total}  {text}"
    width = shutil.get_terminal_size((100, 24)).columns - 1
    out.write("\r" + line[:width].ljust(width))
    out.flush()

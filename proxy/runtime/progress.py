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


class BarProgress:
    """What the commands' progress displays share: a bar redrawn in place on a terminal
    (``tty``), plain lines otherwise (logs, CI). A subclass says how many items are done
    (``counted``) and what the bar's text is (``status``)."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out = out
        self.tty = tty
        self.total = 0
        self._drawn = False

    def planned(self, items: int) -> None:
        self.total += items
        if self.tty:
            self.draw("")

    def finish(self) -> None:
        if self.tty and self._drawn:
            self.out.write("\n")
            self.out.flush()

    def draw(self, label: str) -> None:
        redraw(self.out, self.counted(), self.total, self.status(label))
        self._drawn = True

    def line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def counted(self) -> int:
        raise NotImplementedError

    def status(self, label: str) -> str:
        raise NotImplementedError


def redraw(out: TextIO, done: int, total: int, text: str) -> None:
    """Draw ``[####....] done/total  text`` over the terminal's current line."""
    total = max(total, done, 1)
    filled = BAR_WIDTH * done // total
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    line = f"[{bar}] {done}/{total}  {text}"
    width = shutil.get_terminal_size((100, 24)).columns - 1
    out.write("\r" + line[:width].ljust(width))
    out.flush()

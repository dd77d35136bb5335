"""How ``proxy mirror`` shows a run: a progress bar redrawn in place on a terminal, one
plain line per item otherwise (logs, CI). No dependency: ``\\r`` and a fixed width."""

from __future__ import annotations

import shutil
from typing import TextIO

from proxy.mirror.runner import MirrorSummary, Outcome
from proxy.units import human_size

BAR_WIDTH = 24


def printable(text: str) -> str:
    """``text`` with what a terminal should not get escaped (``\\x1b``, ``\\ud800``): a
    label may be a purl from an SBOM, which is anything. A lone surrogate cannot even
    be encoded, and control characters would rewrite the operator's screen."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class MirrorProgress:
    """``mirrors.Progress`` for a terminal (``tty=True``) or a plain stream."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out = out
        self.tty = tty
        self.total = 0
        self.summary = MirrorSummary()
        self._drawn = False

    def planned(self, items: int) -> None:
        self.total += items
        if self.tty:
            self._draw("")

    def done(self, label: str, outcome: Outcome, size: int) -> None:
        self.summary.add(outcome, size)
        label = printable(label)
        if self.tty:
            self._draw(label)
            return
        sized = f"  {human_size(size)}" if outcome == "fetched" else ""
        self.out.write(f"{outcome:<8} {label}{sized}\n")
        self.out.flush()

    def finish(self) -> None:
        if self.tty and self._drawn:
            self.out.write("\n")
            self.out.flush()

    def _draw(self, label: str) -> None:
        s = self.summary
        done = s.fetched + s.cached + s.missing + s.failed + s.skipped
        total = max(self.total, done, 1)
        filled = BAR_WIDTH * done // total
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        line = (
            f"[{bar}] {done}/{total}  fetched {s.fetched} ({human_size(s.bytes)})  "
            f"cached {s.cached}  failed {s.failed}  {label}"
        )
        width = shutil.get_terminal_size((100, 24)).columns - 1
        self.out.write("\r" + line[:width].ljust(width))
        self.out.flush()
        self._drawn = True

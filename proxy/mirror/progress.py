"""How ``proxy mirror`` shows a run: a progress bar redrawn in place on a terminal, one
plain line per item otherwise (logs, CI). No dependency: ``\\r`` and a fixed width."""

from __future__ import annotations

from typing import TextIO

from proxy.mirror.runner import MirrorSummary, Outcome
from proxy.runtime.progress import printable, redraw
from proxy.units import human_size


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
        redraw(
            self.out,
            done,
            self.total,
            f"fetched {s.fetched} ({human_size(s.bytes)})  cached {s.cached}  "
            f"failed {s.failed}  {label}",
        )
        self._drawn = True

"""How ``proxy mirror`` shows a run: a progress bar redrawn in place on a terminal, one
plain line per item otherwise (logs, CI). No dependency: ``\\r`` and a fixed width."""

from __future__ import annotations

from typing import TextIO

from proxy.mirror.runner import MirrorSummary, Outcome
from proxy.runtime.progress import BarProgress, printable
from proxy.units import human_size


class MirrorProgress(BarProgress):
    """``mirrors.Progress`` for a terminal (``tty=True``) or a plain stream."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        super().__init__(out, tty)
        self.summary = MirrorSummary()

    def done(self, label: str, outcome: Outcome, size: int) -> None:
        self.summary.add(outcome, size)
        label = printable(label)
        if self.tty:
            self.draw(label)
            return
        sized = f"  {human_size(size)}" if outcome == "fetched" else ""
        self.line(f"{outcome:<8} {label}{sized}")

    def counted(self) -> int:
        s = self.summary
        return s.fetched + s.cached + s.missing + s.failed + s.skipped

    def status(self, label: str) -> str:
        s = self.summary
        return (
            f"fetched {s.fetched} ({human_size(s.bytes)})  cached {s.cached}  "
            f"failed {s.failed}  {label}"
        )

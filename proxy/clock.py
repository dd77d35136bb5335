"""Time as a dependency: everything that judges freshness, expiry or schedules asks a
``Clock`` instead of reading the system time itself (docs/architecture.md, "Time").

``SystemClock`` is what runs in production. ``ManualClock`` only moves when a test
advances it, so TTL tests are exact and never sleep. Sleeping itself stays real
(``asyncio.sleep``): the clock decides what time it *is*, not how long to wait.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock time as Unix milliseconds (entry times, freshness, SQLite leases)."""
        ...

    def monotonic(self) -> float:
        """Seconds that never go backwards (how long since a lease was last renewed)."""
        ...


class SystemClock:
    def now_ms(self) -> int:
        return int(time.time() * 1000)

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that stands still until ``advance`` moves it (tests)."""

    def __init__(self, now_ms: int | None = None) -> None:
        self._now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
        self._monotonic = 1000.0

    def now_ms(self) -> int:
        return self._now_ms

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never goes backwards")
        self._now_ms += round(seconds * 1000)
        self._monotonic += seconds

    def step_wall(self, seconds: float) -> None:
        """The wall clock jumps (either way), as an operator or NTP may make it; the
        monotonic clock does not move."""
        self._now_ms += round(seconds * 1000)


SYSTEM_CLOCK = SystemClock()

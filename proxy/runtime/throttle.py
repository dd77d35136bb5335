"""Throttling repeated failures, e.g. wrong passwords: after ``max_failures`` within
``window_s`` for one key (a client address, a user name), that key is refused for a
lockout that doubles with each further failure, up to ``max_lockout_s``.

Written for any credential check (the admin console and API today; the build cache's
Basic auth can use the same). In memory, per process: each replica throttles what it
sees, which bounds a guessing rate per replica without a database write per attempt.
Memory is bounded: keys idle for longer than a window and a lockout are forgotten, and
at most ``max_keys`` are kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_FAILURES = 5
DEFAULT_WINDOW_S = 60.0
DEFAULT_LOCKOUT_S = 30.0
DEFAULT_MAX_LOCKOUT_S = 900.0
DEFAULT_MAX_KEYS = 10_000


@dataclass
class _Record:
    failures: list[float]  # times of recent failures, oldest first
    locked_until: float = 0.0
    lockouts: int = 0


class FailureThrottle:
    def __init__(
        self,
        max_failures: int = DEFAULT_MAX_FAILURES,
        window_s: float = DEFAULT_WINDOW_S,
        lockout_s: float = DEFAULT_LOCKOUT_S,
        max_lockout_s: float = DEFAULT_MAX_LOCKOUT_S,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.lockout_s = lockout_s
        self.max_lockout_s = max_lockout_s
        self.max_keys = max_keys
        self.clock = clock
        self._records: dict[str, _Record] = {}

    def retry_after(self, *keys: str) -> float | None:
        """Seconds until every one of ``keys`` may try again; None if none is locked."""
        now = self.clock()
        waits = [
            record.locked_until - now
            for key in keys
            if (record := self._records.get(key)) is not None and record.locked_until > now
        ]
        return max(waits) if waits else None

    def failed(self, *keys: str) -> None:
        now = self.clock()
        if len(self._records) >= self.max_keys:
            self._forget_idle(now)
        for key in keys:
            record = self._records.setdefault(key, _Record([]))
            record.failures = [t for t in record.failures if now - t < self.window_s]
            record.failures.append(now)
            if len(record.failures) >= self.max_failures:
                lockout_s = min(self.lockout_s * 2**record.lockouts, self.max_lockout_s)
                record.locked_until = now + lockout_s
                record.lockouts += 1
                record.failures.clear()

    def succeeded(self, *keys: str) -> None:
        for key in keys:
            self._records.pop(key, None)

    def _forget_idle(self, now: float) -> None:
        idle_s = self.window_s + self.max_lockout_s
        for key in [
            key
            for key, record in self._records.items()
            if record.locked_until < now
            and (not record.failures or now - record.failures[-1] > idle_s)
        ]:
            del self._records[key]
        while len(self._records) >= self.max_keys:  # still full: the oldest go
            del self._records[next(iter(self._records))]

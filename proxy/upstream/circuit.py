"""Outage memory: one circuit per upstream host (docs/architecture.md, "Upstream safety").

Without it, every request for an expired page asks a dead upstream again and pays a
timeout before its stale copy is served. A circuit is *closed* (requests go out), *open*
(after ``FAILURES_TO_OPEN`` failures in a row: requests fail at once with a 503 and
Retry-After, so a stale copy is served at once and a miss fails fast) or *half-open*
(the backoff window is over: exactly one request goes out as a probe, the others still
fail fast). A probe that succeeds closes the circuit; one that fails opens it again
for twice as long, up to ``BACKOFF_MAX_S``.

What counts as a failure is the host's fault: no connection, no answer head in time, a
body that broke off or trickled, 5xx/429 after retries. A 404, a digest mismatch or a
URL our SSRF policy refuses are answers, not outages.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import random
import time
from collections.abc import Callable

from proxy.exceptions import UpstreamDown
from proxy.runtime import metrics

log = logging.getLogger("proxy.upstream")

FAILURES_TO_OPEN = 3
BACKOFF_MIN_S = 2.0
BACKOFF_MAX_S = 60.0
HALF_OPEN_RETRY_AFTER_S = 1.0  # what waiters are told while a probe is out


class State(enum.IntEnum):
    """The values of ``proxy_upstream_circuit_state``."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class Circuit:
    """The circuit of one upstream host (used on the event loop only)."""

    def __init__(self, host: str, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.state = State.CLOSED
        self.failures = 0  # in a row
        self.backoff_s = BACKOFF_MIN_S
        self.retry_at = 0.0
        self.last_error = ""
        self.down_since: float | None = None  # wall-clock time it opened (for /readyz)
        self._probing = False
        self._monotonic = monotonic
        self._gauge = metrics.UPSTREAM_CIRCUIT_STATE.labels(host=host)
        self._gauge.set(State.CLOSED)

    def admit(self) -> bool:
        """May a request go out now? True if it is the half-open probe; raises the
        fast 503 while the circuit is open (or a probe is already out)."""
        if self.state is State.CLOSED:
            return False
        now = self._monotonic()
        if self.state is State.OPEN and now >= self.retry_at:
            self._set(State.HALF_OPEN)
        if self.state is State.HALF_OPEN and not self._probing:
            self._probing = True
            return True
        wait_s = max(self.retry_at - now, HALF_OPEN_RETRY_AFTER_S)
        raise UpstreamDown(
            f"upstream {self.host} is down (last failure: {self.last_error}); it is not "
            f"asked again for {wait_s:.0f} s",
            retry_after_s=wait_s,
        )

    def succeeded(self, probe: bool) -> None:
        """An answer came (any status but an outage): the host is up."""
        if probe:
            self._probing = False
        self.failures = 0
        if self.state is not State.CLOSED:
            log.warning("upstream %s is back after %.0f s", self.host, self._down_for_s())
            self.backoff_s = BACKOFF_MIN_S
            self.down_since = None
            self._set(State.CLOSED)

    def failed(self, why: str, probe: bool) -> None:
        """The host failed a request (``probe``: the half-open one that ``admit`` let out)."""
        self.last_error = why
        self.failures += 1
        if probe:
            self._probing = False
            self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)
        elif self.state is not State.CLOSED or self.failures < FAILURES_TO_OPEN:
            return  # still closed; or a request sent before it opened: the window stands
        else:
            self.down_since = time.time()
        wait_s = self.backoff_s * random.uniform(0.8, 1.0)
        self.retry_at = self._monotonic() + wait_s
        self._set(State.OPEN)
        log.warning(
            "upstream %s is down after %d failures in a row (last: %s); requests fail at "
            "once for %.0f s, then one probe",
            self.host,
            self.failures,
            why,
            wait_s,
        )

    def release(self, probe: bool) -> None:
        """A request ended with neither verdict (refused by our policy, cancelled)."""
        if probe:
            self._probing = False

    def forget(self) -> None:
        """No longer kept (``UpstreamPool.circuit``): its gauge's label goes too."""
        with contextlib.suppress(KeyError):
            metrics.UPSTREAM_CIRCUIT_STATE.remove(self.host)

    def _down_for_s(self) -> float:
        return time.time() - self.down_since if self.down_since is not None else 0.0

    def _set(self, state: State) -> None:
        self.state = state
        self._gauge.set(state)

    def describe(self) -> str | None:
        """A line for /readyz while the host is down; None when it is up."""
        if self.state is State.CLOSED:
            return None
        return (
            f"upstream {self.host} is down for {self._down_for_s():.0f} s "
            f"(circuit {self.state.name.lower().replace('_', '-')}: {self.last_error})"
        )

"""How each upstream host has been answering this process: counts and the last error.

Every replica's heartbeat carries its snapshot (docs/architecture.md, "Operating:
console, API and logs"); the console merges them into upstream health per host for
the fleet. Wall-clock times: they are only shown.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

from proxy.redaction import redact

ERROR_MAX_CHARS = 300


@dataclass
class HostHealth:
    answers: int = 0  # response heads received (any status the upstream chose)
    failures: int = 0  # no usable answer: unreachable, timed out, 5xx after retries
    last_answer_ms: int | None = None
    last_failure_ms: int | None = None
    last_error: str | None = None


class UpstreamHealth:
    """At most ``max_hosts`` hosts, the least recently heard of forgotten first (a
    redirect may name any host; the heartbeat row carries them all)."""

    def __init__(self, max_hosts: int) -> None:
        self.max_hosts = max_hosts
        self.hosts: OrderedDict[str, HostHealth] = OrderedDict()

    def answered(self, host: str) -> None:
        health = self._of(host)
        health.answers += 1
        health.last_answer_ms = int(time.time() * 1000)

    def failed(self, host: str, error: str) -> None:
        health = self._of(host)
        health.failures += 1
        health.last_failure_ms = int(time.time() * 1000)
        health.last_error = redact(error)[:ERROR_MAX_CHARS]

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {host: asdict(health) for host, health in self.hosts.items()}

    def _of(self, host: str) -> HostHealth:
        health = self.hosts.get(host)
        if health is not None:
            self.hosts.move_to_end(host)
            return health
        while len(self.hosts) >= self.max_hosts:
            self.hosts.popitem(last=False)
        health = self.hosts[host] = HostHealth()
        return health

"""Fetch leases across processes (docs/architecture.md, "Fetch leases"), on either
catalog backend.

A process that misses a key claims its lease before fetching; while it downloads it
renews every TTL/3. Other processes wait for the outcome instead of fetching too.

Safety rules, and why:
- The claim, renewal and release are single statements in the catalog; renew and
  release match key + holder + fence + 'fetching', so anything left over from an
  earlier mandate touches nothing.
- A renewal that matches no row, or no successful renewal for longer than the TTL
  (database unreachable), means the lease is lost: another process may have taken it,
  and we cannot ask. From then on we never mark or release anything under that fence.
- Clean shutdown releases every held lease and waits for the write, so a replacement
  takes over at once instead of after one TTL.
- Waiting is bounded by the holder's renewals and the lease expiry (judged by the
  database clock), never by a count of polls. Notifications (Postgres LISTEN/NOTIFY)
  wake waiters early; jittered polling is the truth when one is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import random
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxy.catalog import Catalog, Entry, LeaseGrant, LeaseRow, StreamInfo
from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.config.settings import LeaseSettings
from proxy.exceptions import CatalogError
from proxy.runtime import metrics
from proxy.runtime.tasks import TaskSupervisor

log = logging.getLogger("proxy.leases")

RELEASE_TIMEOUT_S = 5.0
RENEW_RETRY_S = 0.5  # after a failed renewal, try again this soon (at most TTL/3)
POLL_JITTER_MIN = 0.5  # polls sleep between this fraction and all of poll_interval


def make_holder_id() -> str:
    """Who we are in lease rows: host, pid and a random part (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def lease_key(repository: str, key: str) -> str:
    return f"{repository}/{key}"


class Verdict(enum.Enum):
    ENTRY = "entry"  # the holder stored the entry: serve it
    FAILED = "failed"  # the holder's upstream fetch failed: serve stale or fetch ourselves
    TAKEOVER = "takeover"  # released without an entry, or the holder stopped renewing
    STREAM = "stream"  # the holder announced the file it is writing: serve it as it grows


@dataclass(frozen=True)
class WaitResult:
    verdict: Verdict
    entry: Entry | None = None
    fence: int | None = None
    stream: StreamInfo | None = None


class HeldLease:
    """Our mandate on one key, renewed in the background while we fetch."""

    def __init__(
        self, coordinator: LeaseCoordinator, grant: LeaseGrant, repository: str, sent_at: float
    ) -> None:
        self.coordinator = coordinator
        self.grant = grant
        self.repository = repository
        self.lost = False
        self.released = False
        # When the claim was *sent*: the database set the expiry no earlier than that,
        # so measuring from here never overstates how long the lease is ours.
        self._last_renewed = sent_at
        self._renewer: asyncio.Task[None] | None = None

    @property
    def fence(self) -> int:
        return self.grant.fence

    def _mark_lost(self, why: str) -> None:
        if self.lost:
            return
        self.lost = True
        metrics.LEASE_LOSSES.labels(repository=self.repository).inc()
        log.warning(
            "lease lost key=%s fence=%d holder=%s: %s; not touching it again",
            self.grant.key,
            self.fence,
            self.grant.holder,
            why,
        )

    async def _renew_forever(self) -> None:
        ttl_s = self.coordinator.ttl_s
        interval_s = ttl_s / 3
        delay_s = interval_s
        while not self.lost and not self.released:
            await asyncio.sleep(delay_s)
            if self.released:
                return
            sent = self.coordinator.clock.monotonic()
            try:
                async with asyncio.timeout(interval_s):
                    ok = await self.coordinator.catalog.renew_lease(self.grant, ttl_s)
            except (CatalogError, TimeoutError) as exc:
                silent_s = self.coordinator.clock.monotonic() - self._last_renewed
                if silent_s > ttl_s:
                    self._mark_lost(f"database unreachable for {silent_s:.1f}s ({exc})")
                    return
                log.warning(
                    "lease renewal failed key=%s fence=%d: %s", self.grant.key, self.fence, exc
                )
                delay_s = min(interval_s, RENEW_RETRY_S)  # retry soon: the TTL is running
                continue
            if not ok:
                self._mark_lost("the renewal matched no row (taken over)")
                return
            if sent - self._last_renewed > ttl_s:
                # The row still carried our fence, but we were silent past the TTL: someone
                # may have judged it expired and be fetching too. Exclusivity is gone.
                self._mark_lost("renewed only after the TTL had passed")
                return
            self._last_renewed = sent
            delay_s = interval_s

    async def announce_stream(self, stream: StreamInfo) -> None:
        """Tell waiting processes which file we are writing (best effort: without it
        they still get the entry when we are done)."""
        if self.lost or self.released:
            return
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await self.coordinator.catalog.announce_stream(self.grant, stream)
        except (CatalogError, TimeoutError) as exc:
            log.warning("stream announcement failed key=%s: %s", self.grant.key, exc)

    async def release(self, state: str) -> None:
        """End the mandate with ``state``; a no-op if the lease was lost."""
        if self.released:
            return
        self.released = True
        if self._renewer is not None:
            self._renewer.cancel()
        self.coordinator._held.discard(self)
        silent_s = self.coordinator.clock.monotonic() - self._last_renewed
        if self.lost or silent_s > self.coordinator.ttl_s:
            self._mark_lost("expired before release")
            return
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                ok = await self.coordinator.catalog.release_lease(self.grant, state)
        except (CatalogError, TimeoutError) as exc:
            log.warning("lease release failed key=%s fence=%d: %s", self.grant.key, self.fence, exc)
            return
        if not ok:
            self._mark_lost("the release matched no row")
        elif state == "failed":
            metrics.LEASE_FAILED_MARKS.labels(repository=self.repository).inc()
        log.debug("lease released key=%s fence=%d state=%s", self.grant.key, self.fence, state)


class LeaseCoordinator:
    """Claims, renews, releases and waits on fetch leases for this process."""

    def __init__(
        self,
        catalog: Catalog,
        settings: LeaseSettings,
        tasks: TaskSupervisor,
        holder: str,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.catalog = catalog
        self.clock = clock
        self.ttl_s = settings.ttl_s
        self.poll_interval_s = settings.poll_interval_s
        self.tasks = tasks
        self.holder = holder
        self._held: set[HeldLease] = set()
        self._wakeups: dict[str, set[asyncio.Event]] = {}

    async def claim(self, repository: str, key: str) -> HeldLease | None:
        sent_at = self.clock.monotonic()
        claiming = asyncio.ensure_future(
            self.catalog.claim_lease(lease_key(repository, key), self.holder, self.ttl_s)
        )
        try:
            grant = await asyncio.shield(claiming)
        except asyncio.CancelledError:
            # The claim may commit although we stop waiting for it (shutdown): hand it
            # back at once, or the next holder would wait out a whole TTL.
            with contextlib.suppress(Exception):
                late = await claiming
                if late is not None:
                    await self.catalog.release_lease(late, "released")
            raise
        metrics.LEASE_CLAIMS.labels(
            repository=repository, result="won" if grant else "held_elsewhere"
        ).inc()
        if grant is None:
            return None
        held = HeldLease(self, grant, repository, sent_at)
        self._held.add(held)
        held._renewer = self.tasks.spawn(f"lease-renew:{grant.key}", held._renew_forever())
        return held

    async def wait(
        self,
        repository: str,
        key: str,
        find_entry: Callable[[], Awaitable[Entry | None]],
        following: int | None = None,
    ) -> WaitResult:
        """Wait, detached from any client, until the holder's outcome is known, or until
        a holder other than ``following`` (a fence) announces the file it is writing."""
        lkey = lease_key(repository, key)
        started = self.clock.monotonic()
        outcome = "error"
        try:
            while True:
                wakeup = asyncio.Event()
                self._wakeups.setdefault(lkey, set()).add(wakeup)
                try:
                    result = await self._look(lkey, find_entry, following)
                    if result is not None:
                        outcome = result.verdict.value
                        return result
                    delay_s = self.poll_interval_s * random.uniform(POLL_JITTER_MIN, 1.0)
                    try:
                        async with asyncio.timeout(delay_s):
                            await wakeup.wait()
                    except TimeoutError:
                        pass
                finally:
                    waiters = self._wakeups.get(lkey)
                    if waiters is not None:
                        waiters.discard(wakeup)
                        if not waiters:
                            del self._wakeups[lkey]
        finally:
            metrics.LEASE_WAIT_DURATION.labels(repository=repository, outcome=outcome).observe(
                self.clock.monotonic() - started
            )

    async def _look(
        self,
        lkey: str,
        find_entry: Callable[[], Awaitable[Entry | None]],
        following: int | None,
    ) -> WaitResult | None:
        entry = await find_entry()
        if entry is not None:
            return WaitResult(Verdict.ENTRY, entry=entry)
        row: LeaseRow | None = await self.catalog.get_lease(lkey)
        if row is None:
            return WaitResult(Verdict.TAKEOVER)
        if row.state == "fetching":
            if row.expired:
                return WaitResult(Verdict.TAKEOVER, fence=row.fence)
            if row.stream is not None and row.fence != following:
                return WaitResult(Verdict.STREAM, fence=row.fence, stream=row.stream)
            return None
        if row.state == "failed":
            return WaitResult(Verdict.FAILED, fence=row.fence)
        if row.state == "done":
            # The entry may have landed between our two reads.
            entry = await find_entry()
            if entry is not None:
                return WaitResult(Verdict.ENTRY, entry=entry)
        return WaitResult(Verdict.TAKEOVER, fence=row.fence)

    def notify(self, lkey: str) -> None:
        """A lease transition was announced (from LISTEN/NOTIFY): wake its waiters now."""
        metrics.LEASE_NOTIFICATIONS.inc()
        for event in self._wakeups.get(lkey, ()):
            event.set()

    async def release_all(self) -> None:
        """Clean shutdown: hand every held lease back and wait for the writes."""
        held = list(self._held)
        if held:
            await asyncio.gather(*(h.release("released") for h in held), return_exceptions=True)
            log.info("released %d fetch lease(s) at shutdown", len(held))

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
  carry the row: a waiter follows an announced stream and learns the outcome from
  them. It reads the row only at the lease's renewal pace (ttl/3) while notifications
  arrive, and when the lease would expire; at ``leases.poll_interval`` while they
  may be missed (docs/architecture.md, "Waiting on a lease").
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
from dataclasses import dataclass, field

from proxy.catalog import Catalog, Entry, LeaseGrant, LeaseRow, StreamInfo
from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.config.settings import LeaseSettings
from proxy.exceptions import CatalogError
from proxy.runtime import metrics
from proxy.runtime.tasks import TaskSupervisor

log = logging.getLogger("proxy.leases")

RELEASE_TIMEOUT_S = 5.0
RENEW_RETRY_S = 0.5  # after a failed renewal, try again this soon (at most TTL/3)
POLL_JITTER_MIN = 0.8  # a waiter sleeps between this fraction and all of its pace
EXPIRY_MARGIN_S = 0.05  # look again this long after the lease would expire


def make_holder_id() -> str:
    """Who we are in lease rows: host, pid and a random part (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def lease_key(repository: str, key: str) -> str:
    return f"{repository}/{key}"


class Verdict(enum.Enum):
    ENTRY = "entry"  # the holder stored the entry: serve it
    FAILED = "failed"  # the holder's upstream fetch failed: serve stale or fetch ourselves
    TAKEOVER = "takeover"  # released without an entry, or the holder stopped renewing


@dataclass(frozen=True)
class WaitResult:
    verdict: Verdict
    entry: Entry | None = None
    fence: int | None = None
    # A takeover of a lease the database still calls live: (fence, renewal stamp) of the
    # row this waiter saw go unrenewed for a whole TTL (LeaseCoordinator.claim).
    unrenewed: tuple[int, float] | None = None


@dataclass(eq=False)
class _Waiter:
    """One wait on one key: woken by a notification (which leaves the row it carried,
    or None: look it up) or by a change in whether notifications arrive."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    row: LeaseRow | None = None


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
        # (bytes written, requests sharing it): reported with each renewal, for the
        # console's "in flight now" (no statement of its own).
        self.progress: Callable[[], tuple[int, int]] | None = None

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
                written, waiters = self.progress() if self.progress is not None else (None, None)
                async with asyncio.timeout(interval_s):
                    ok = await self.coordinator.catalog.renew_lease(
                        self.grant, ttl_s, written, waiters
                    )
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
        self._waiters: dict[str, set[_Waiter]] = {}
        # Are lease notifications being received? Set by the catalog's listener; a
        # backend without notifications never sets it.
        self.listening = False

    async def claim(
        self,
        repository: str,
        key: str,
        unless_stored: bool = True,
        unrenewed: tuple[int, float] | None = None,
    ) -> HeldLease | None:
        """Our mandate on the key, or None: another holder's live lease stands, or (with
        ``unless_stored``) the entry is stored and fresh by its stored expiry, as after
        a holder stored it since our lookup. The caller waits either way, and the wait
        finds the entry. A caller that has just found no fresh entry by its own
        judgment (a wait that ended in a takeover) claims without ``unless_stored``: an
        entry that the stored expiry calls fresh and the current TTLs do not
        (``fetch.fetcher.under_current_ttl``) must not keep it from ever claiming.
        ``unrenewed``: the row a wait saw go unrenewed for a TTL (``WaitResult``)."""
        sent_at = self.clock.monotonic()
        unless_fresh = (repository, key, self.clock.now_ms()) if unless_stored else None
        claiming = asyncio.ensure_future(
            self.catalog.claim_lease(
                lease_key(repository, key),
                self.holder,
                self.ttl_s,
                unless_fresh=unless_fresh,
                unrenewed=unrenewed,
            )
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
        on_stream: Callable[[StreamInfo, int], Awaitable[None]],
    ) -> WaitResult:
        """Wait, detached from any client, until the holder's outcome is known. Each
        file (or relay) a holder announces is handed to ``on_stream`` once, with the
        holder's fence, and the wait goes on:
        a waiter that follows the holder's stream claims no more."""
        lkey = lease_key(repository, key)
        started = self.clock.monotonic()
        outcome = "error"
        waiter = _Waiter()
        self._waiters.setdefault(lkey, set()).add(waiter)
        following: int | None = None  # the fence whose announced file we gave on
        try:
            row = await self._read(lkey)
            seen = -1
            # When the lease last read would expire unless renewed (monotonic). Kept
            # across notifications, which carry no expiry: a holder that dies after
            # announcing its stream is then looked for at its expiry, not a pace later.
            deadline: float | None = None
            # The row's (fence, renewal stamp) as last read, and since when (monotonic)
            # it has stood unchanged: a holder that has not renewed for a whole TTL by
            # our own clock is dead, whatever the database's clock says of its expiry
            # (docs/architecture.md, "Fetch leases": a clock that steps back).
            watched: tuple[int, float] | None = None
            watched_since = started
            while row is not None and row.state == "fetching" and not row.expired:
                seen = max(seen, row.fence)
                now = self.clock.monotonic()
                if row.remaining_s is not None:
                    deadline = now + row.remaining_s
                if row.renewed is not None:
                    stamp = (row.fence, row.renewed)
                    if stamp != watched:
                        watched, watched_since = stamp, now
                    elif now - watched_since > self.ttl_s + EXPIRY_MARGIN_S:
                        log.warning(
                            "lease %s: fence %d not renewed for %.0f s by this replica's"
                            " clock though the database calls it live (its clock stepped"
                            " back?): taking it over",
                            lkey,
                            row.fence,
                            now - watched_since,
                        )
                        outcome = Verdict.TAKEOVER.value
                        return WaitResult(Verdict.TAKEOVER, fence=row.fence, unrenewed=stamp)
                if row.stream is not None and row.fence != following:
                    following = row.fence
                    await on_stream(row.stream, row.fence)
                # Look again when it would expire, or when it will have gone a TTL
                # unrenewed, whichever comes first.
                unrenewed_by = watched_since + self.ttl_s + 2 * EXPIRY_MARGIN_S
                look_at = unrenewed_by if deadline is None else min(deadline, unrenewed_by)
                row = await self._next(lkey, waiter, seen, look_at)
            result = await self._outcome(row, find_entry)
            outcome = result.verdict.value
            return result
        finally:
            waiters = self._waiters.get(lkey)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[lkey]
            metrics.LEASE_WAIT_DURATION.labels(repository=repository, outcome=outcome).observe(
                self.clock.monotonic() - started
            )

    async def _next(
        self, lkey: str, waiter: _Waiter, seen: int, deadline: float | None
    ) -> LeaseRow | None:
        """The live lease's next state: as a notification carried it, or read when the
        pace says to look (or at ``deadline``, when the lease would expire unless it is
        renewed)."""
        while True:
            delay_s = self.pace_s() * random.uniform(POLL_JITTER_MIN, 1.0)
            if deadline is not None:
                until_expiry_s = max(deadline - self.clock.monotonic(), 0.0)
                delay_s = min(delay_s, until_expiry_s + EXPIRY_MARGIN_S)
            try:
                async with asyncio.timeout(delay_s):
                    await waiter.event.wait()
            except TimeoutError:
                return await self._read(lkey)
            waiter.event.clear()
            notified, waiter.row = waiter.row, None
            if notified is None:
                return await self._read(lkey)
            if notified.fence >= seen:
                return notified
            # A late notification of an earlier mandate: the row has moved on since.

    async def _read(self, lkey: str) -> LeaseRow | None:
        """The lease's row. A database that does not answer (a restart, a failover) is
        asked again every ``leases.poll_interval`` for up to one TTL, as long as the
        holder rides out an outage without losing its lease; then the error stands
        (docs/architecture.md, "Waiting on a lease")."""
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        while True:
            try:
                return await self.catalog.get_lease(lkey)
            except CatalogError as exc:
                if failing_since is None:
                    failing_since = loop.time()
                    log.warning("lease wait key=%s: database unavailable (%s); retrying", lkey, exc)
                elif loop.time() - failing_since >= self.ttl_s:
                    raise
            await asyncio.sleep(self.poll_interval_s)

    async def _outcome(
        self, row: LeaseRow | None, find_entry: Callable[[], Awaitable[Entry | None]]
    ) -> WaitResult:
        """What a lease that is no longer live came to. The entry first: it may be
        stored whatever the row says (released, expired, purged) and then it is the
        answer."""
        entry = await find_entry()
        if entry is not None:
            return WaitResult(Verdict.ENTRY, entry=entry)
        if row is None:
            return WaitResult(Verdict.TAKEOVER)
        if row.state == "failed":
            return WaitResult(Verdict.FAILED, fence=row.fence)
        return WaitResult(Verdict.TAKEOVER, fence=row.fence)  # expired, released, done

    def pace_s(self) -> float:
        """How long a waiter sleeps between looks at a live lease: the lease's renewal
        pace while notifications arrive (they tell it of every change but an expiry),
        ``leases.poll_interval`` while they may be missed."""
        return self.ttl_s / 3 if self.listening else self.poll_interval_s

    def notify(self, lkey: str, row: LeaseRow | None) -> None:
        """A lease transition was announced (LISTEN/NOTIFY): wake its waiters now, with
        the row it carried (None: they read it)."""
        metrics.LEASE_NOTIFICATIONS.inc()
        for waiter in self._waiters.get(lkey, ()):
            if row is None or waiter.row is None or row.fence >= waiter.row.fence:
                waiter.row = row
            waiter.event.set()

    def set_listening(self, listening: bool) -> None:
        """From the catalog's listener: notifications are being received, or may be
        missed from now on. Every waiter looks again at once, since one may have been
        missed in between, and sleeps at its new pace."""
        self.listening = listening
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.row = None
                waiter.event.set()

    async def release_all(self) -> None:
        """Clean shutdown: hand every held lease back and wait for the writes."""
        held = list(self._held)
        if held:
            await asyncio.gather(*(h.release("released") for h in held), return_exceptions=True)
            log.info("released %d fetch lease(s) at shutdown", len(held))

"""An in-memory ``catalog.Catalog`` (docs/architecture.md, "Test seams"): every
operation of the protocol, leases with fences, tombstones and job runs included, judged
by a ``Clock``. The catalog's own tests run on it as on SQLite and Postgres.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from proxy.catalog import (
    Entry,
    JobRun,
    LeaseGrant,
    LeaseRow,
    Removed,
    StorageUsage,
    StreamInfo,
    Usage,
)
from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.exceptions import CatalogError
from proxy.types import Kind, Link, LinkBatch


@dataclass
class _Lease:
    holder: str
    fence: int
    state: str
    acquired_at: int
    renewed_at: int
    expires_at: int
    stream: StreamInfo | None = None


@dataclass
class _JobRun:
    run_id: int
    started_at_ms: int
    previous_started_at_ms: int | None
    holder: str
    outcome: str | None
    finished_at_ms: int | None = None


class MemoryCatalog:
    """The ``Catalog`` protocol in one process's memory.

    Statements of the SQL backends are single operations here (no ``await`` inside
    one), so they are as atomic as the databases make them. Set ``outage`` to make
    every operation fail with ``CatalogError``, as an unreachable database does.
    """

    backend = "memory"

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.outage: str | None = None  # a reason: every operation fails while set
        self.entries: dict[tuple[str, str], Entry] = {}
        self.links: dict[tuple[str, str], Link] = {}
        self.leases: dict[str, _Lease] = {}
        self.tombstones: dict[str, tuple[int, int]] = {}  # sha256 -> (size, at ms)
        self.job_history: dict[str, _JobRun] = {}
        self._order: dict[tuple[str, str], int] = {}  # insertion order (the SQL rowid)
        self._next_row = 0
        self._fence = 0
        self._job_locks: set[str] = set()
        self._listeners: list[Callable[[str, LeaseRow | None], None]] = []
        self._closed = False

    async def _enter(self, operation: str) -> None:
        await asyncio.sleep(0)  # a database call always yields to the loop
        if self._closed:
            raise CatalogError(f"memory catalog: {operation} after close")
        if self.outage is not None:
            raise CatalogError(f"memory catalog: {operation}: {self.outage}")

    def _now(self) -> int:
        return self.clock.now_ms()

    # -- plumbing --------------------------------------------------------------------------

    async def migrate(self) -> list[str]:
        await self._enter("migrate")
        return []

    async def close(self) -> None:
        self._closed = True

    async def ping(self) -> None:
        await self._enter("ping")

    # -- entries -----------------------------------------------------------------------------

    async def get_entry(self, repository: str, key: str) -> Entry | None:
        await self._enter("get_entry")
        entry = self.entries.get((repository, key))
        return _copy(entry) if entry is not None else None

    async def put_entry(self, entry: Entry) -> None:
        await self._enter("put_entry")
        ident = (entry.repository, entry.key)
        old = self.entries.get(ident)
        access = entry.last_access_ms or entry.fetched_at_ms
        if old is not None:
            access = max(old.last_access_ms, access)
            if old.sha256 is not None and old.sha256 != entry.sha256:
                self._tombstone(old)
        else:
            self._order[ident] = self._next_row
            self._next_row += 1
        self.entries[ident] = dataclasses.replace(_copy(entry), last_access_ms=access)

    async def refresh_entry(self, entry: Entry) -> None:
        await self._enter("refresh_entry")
        ident = (entry.repository, entry.key)
        old = self.entries.get(ident)
        if old is not None and old.sha256 == entry.sha256:
            self.entries[ident] = dataclasses.replace(
                old,
                fetched_at_ms=entry.fetched_at_ms,
                expires_at_ms=entry.expires_at_ms,
                etag=entry.etag,
                last_modified=entry.last_modified,
            )

    async def delete_entry(self, repository: str, key: str, sha256: str | None) -> bool:
        await self._enter("delete_entry")
        old = self.entries.get((repository, key))
        if old is None or (sha256 is not None and old.sha256 != sha256):
            return False
        self._delete(old)
        return True

    async def touch_entries(self, accesses: Sequence[tuple[str, str, int]]) -> None:
        await self._enter("touch_entries")
        for repository, key, at_ms in accesses:
            old = self.entries.get((repository, key))
            if old is not None:
                access = max(old.last_access_ms, at_ms)
                self.entries[(repository, key)] = dataclasses.replace(old, last_access_ms=access)

    async def usage(self, repository: str) -> Usage:
        await self._enter("usage")
        sizes = [e.size for (repo, _), e in self.entries.items() if repo == repository]
        return Usage(entries=len(sizes), bytes=sum(sizes))

    async def least_recently_used(self, repository: str, limit: int) -> list[Entry]:
        await self._enter("least_recently_used")
        found = [
            e
            for e in self.entries.values()
            if e.repository == repository and e.kind is not Kind.NEGATIVE
        ]
        return [_copy(e) for e in self._by_access(found)[:limit]]

    async def unreferenced_blobs(self, sha256s: Sequence[str]) -> set[str]:
        await self._enter("unreferenced_blobs")
        used = self._referenced()
        return {sha for sha in sha256s if sha not in used and sha not in self.tombstones}

    async def storage_usage(self) -> StorageUsage:
        await self._enter("storage_usage")
        proxied = [e.size for e in self.entries.values() if e.kind in _PROXIED]
        hosted = sum(e.size for e in self.entries.values() if e.kind is Kind.HOSTED)
        tombstoned = sum(size for size, _at in self.tombstones.values())
        return StorageUsage(len(proxied), sum(proxied), hosted, tombstoned)

    async def evict_lru(self, free_bytes: int, limit: int) -> list[Removed]:
        await self._enter("evict_lru")
        candidates = self._by_access([e for e in self.entries.values() if e.kind in _PROXIED])
        removed = []
        freed = 0
        for entry in candidates[:limit]:
            if freed >= free_bytes:
                break
            freed += entry.size
            self._delete(entry)
            removed.append(Removed(entry.repository, entry.key, entry.sha256, entry.size))
        return removed

    async def expire_unused(self, repository: str, before_ms: int, limit: int) -> list[Removed]:
        await self._enter("expire_unused")
        unused = [
            e
            for e in self.entries.values()
            if e.repository == repository and e.last_access_ms < before_ms and e.kind in _PROXIED
        ][:limit]
        for entry in unused:
            self._delete(entry)
        return [Removed(e.repository, e.key, e.sha256, e.size) for e in unused]

    async def drop_referenced_tombstones(self) -> int:
        await self._enter("drop_referenced_tombstones")
        used = self._referenced() & self.tombstones.keys()
        for sha in used:
            del self.tombstones[sha]
        return len(used)

    async def due_tombstones(self, grace_s: float, after: str, limit: int) -> list[tuple[str, int]]:
        await self._enter("due_tombstones")
        cutoff = self._now() - int(grace_s * 1000)
        used = self._referenced()
        due = [
            (sha, size)
            for sha, (size, at_ms) in sorted(self.tombstones.items())
            if sha > after and at_ms <= cutoff and sha not in used
        ]
        return due[:limit]

    async def forget_tombstones(self, sha256s: Sequence[str]) -> int:
        await self._enter("forget_tombstones")
        gone = [sha for sha in set(sha256s) if sha in self.tombstones]
        for sha in gone:
            del self.tombstones[sha]
        return len(gone)

    async def delete_expired_negatives(self, older_than_ms: int) -> int:
        await self._enter("delete_expired_negatives")
        expired = [
            e
            for e in self.entries.values()
            if e.kind is Kind.NEGATIVE
            and e.expires_at_ms is not None
            and e.expires_at_ms < older_than_ms
        ]
        for entry in expired:
            self._delete(entry)
        return len(expired)

    def _delete(self, entry: Entry) -> None:
        ident = (entry.repository, entry.key)
        del self.entries[ident]
        self._order.pop(ident, None)
        if entry.sha256 is not None:
            self._tombstone(entry)

    def _tombstone(self, entry: Entry) -> None:
        # What the backends' triggers do: every blob that loses a reference is noted.
        assert entry.sha256 is not None
        self.tombstones[entry.sha256] = (entry.size, self._now())

    def _referenced(self) -> set[str]:
        return {e.sha256 for e in self.entries.values() if e.sha256 is not None}

    def _by_access(self, entries: Iterable[Entry]) -> list[Entry]:
        return sorted(
            entries, key=lambda e: (e.last_access_ms, self._order.get((e.repository, e.key), 0))
        )

    # -- links -----------------------------------------------------------------------------

    async def put_links(self, links: Sequence[Link] | LinkBatch) -> None:
        await self._enter("put_links")
        if isinstance(links, LinkBatch):
            rows = json.loads(links.json_text)
            links = [
                Link(r["repository"], r["key"], r["url"], dict(r["digests"] or {}), r["size"])
                for r in rows
            ]
        for link in links:
            self.links[(link.repository, link.key)] = dataclasses.replace(
                link, digests=dict(link.digests)
            )

    async def get_link(self, repository: str, key: str) -> Link | None:
        await self._enter("get_link")
        link = self.links.get((repository, key))
        return dataclasses.replace(link, digests=dict(link.digests)) if link is not None else None

    # -- fetch leases --------------------------------------------------------------------------

    async def claim_lease(
        self,
        key: str,
        holder: str,
        ttl_s: float,
        unless_fresh: tuple[str, str, int] | None = None,
    ) -> LeaseGrant | None:
        await self._enter("claim_lease")
        now = self._now()
        row = self.leases.get(key)
        if (
            row is not None
            and row.holder != holder
            and row.state == "fetching"
            and row.expires_at > now
        ):
            return None
        if unless_fresh is not None:
            repository, entry_key, at_ms = unless_fresh
            entry = self.entries.get((repository, entry_key))
            if entry is not None and entry.is_fresh(at_ms):
                return None
        self._fence += 1  # a sequence: it grows on every claim and never goes back
        self.leases[key] = _Lease(
            holder, self._fence, "fetching", now, now, now + int(ttl_s * 1000)
        )
        self._notify(key, self.leases[key])
        return LeaseGrant(key=key, holder=holder, fence=self._fence)

    def _mandate(self, grant: LeaseGrant) -> _Lease | None:
        row = self.leases.get(grant.key)
        if (
            row is None
            or row.holder != grant.holder
            or row.fence != grant.fence
            or row.state != "fetching"
        ):
            return None
        return row

    async def renew_lease(self, grant: LeaseGrant, ttl_s: float) -> bool:
        await self._enter("renew_lease")
        row = self._mandate(grant)
        if row is None:
            return False
        row.renewed_at = self._now()
        row.expires_at = row.renewed_at + int(ttl_s * 1000)
        return True

    async def release_lease(self, grant: LeaseGrant, state: str) -> bool:
        await self._enter("release_lease")
        row = self._mandate(grant)
        if row is None:
            return False
        row.state = state
        row.expires_at = max(self._now(), row.acquired_at)
        self._notify(grant.key, row)
        return True

    async def announce_stream(self, grant: LeaseGrant, stream: StreamInfo) -> bool:
        await self._enter("announce_stream")
        row = self._mandate(grant)
        if row is None:
            return False
        row.stream = stream
        self._notify(grant.key, row)
        return True

    async def get_lease(self, key: str) -> LeaseRow | None:
        await self._enter("get_lease")
        row = self.leases.get(key)
        if row is None:
            return None
        expired = row.expires_at <= self._now()
        remaining_s = max(row.expires_at - self._now(), 0) / 1000
        return LeaseRow(key, row.holder, row.fence, row.state, expired, row.stream, remaining_s)

    async def purge_leases(self, retention_s: float) -> int:
        await self._enter("purge_leases")
        cutoff = self._now() - int(retention_s * 1000)
        old = [key for key, row in self.leases.items() if row.expires_at < cutoff]
        for key in old:
            del self.leases[key]
        return len(old)

    def _notify(self, key: str, row: _Lease) -> None:
        notified = LeaseRow(key, row.holder, row.fence, row.state, False, row.stream)
        for listener in list(self._listeners):
            listener(key, notified)

    async def listen_leases(
        self,
        on_notify: Callable[[str, LeaseRow | None], None],
        on_listening: Callable[[bool], None] | None = None,
    ) -> None:
        """Every change of a lease's state, fence or stream, delivered at once with the
        row (as Postgres' NOTIFY does, and never lost), until cancelled."""
        self._listeners.append(on_notify)
        if on_listening is not None:
            on_listening(True)
        try:
            await asyncio.Event().wait()
        finally:
            self._listeners.remove(on_notify)

    # -- background jobs ----------------------------------------------------------------------

    @asynccontextmanager
    async def job_lock(self, name: str) -> AsyncIterator[bool]:
        await self._enter("job_lock")
        if name in self._job_locks:
            yield False
            return
        self._job_locks.add(name)
        try:
            yield True
        finally:
            self._job_locks.discard(name)

    async def claim_job_run(self, name: str, interval_s: float, holder: str) -> int | None:
        await self._enter("claim_job_run")
        now = self._now()
        run = self.job_history.get(name)
        if run is None:
            self.job_history[name] = _JobRun(1, now, None, holder, "running")
            return 1
        if run.started_at_ms > now - int(interval_s * 1000):
            return None
        self.job_history[name] = _JobRun(run.run_id + 1, now, run.started_at_ms, holder, "running")
        return run.run_id + 1

    async def give_back_job_run(self, name: str, run_id: int) -> None:
        await self._enter("give_back_job_run")
        run = self.job_history.get(name)
        if run is not None and run.run_id == run_id:
            run.started_at_ms = run.previous_started_at_ms or 0
            run.outcome = "cancelled"
            run.finished_at_ms = self._now()

    async def finish_job_run(self, name: str, run_id: int, outcome: str) -> None:
        await self._enter("finish_job_run")
        run = self.job_history.get(name)
        if run is not None and run.run_id == run_id:
            run.outcome = outcome
            run.finished_at_ms = self._now()

    async def job_runs(self) -> tuple[list[JobRun], int]:
        await self._enter("job_runs")
        runs = [
            JobRun(
                name=name,
                run_id=run.run_id,
                started_at_ms=run.started_at_ms or None,
                finished_at_ms=run.finished_at_ms,
                outcome=run.outcome,
                holder=run.holder,
            )
            for name, run in sorted(self.job_history.items())
        ]
        return runs, self._now()


_PROXIED = (Kind.IMMUTABLE, Kind.METADATA)


def _copy(entry: Entry) -> Entry:
    return dataclasses.replace(entry, digests=dict(entry.digests))

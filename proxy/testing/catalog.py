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
from typing import Any

from proxy.catalog import (
    MIRROR_COUNTS,
    Entry,
    EntrySummary,
    InFlight,
    JobFailure,
    JobRun,
    KnownTimes,
    LeaseGrant,
    LeaseRow,
    MirrorRun,
    PackageSummary,
    Purge,
    Removed,
    Replica,
    StorageUsage,
    StreamInfo,
    Usage,
)
from proxy.catalog.base import JOB_FAILURES_KEPT
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
    written: int | None = None
    waiters: int | None = None


@dataclass
class _JobRun:
    run_id: int
    started_at_ms: int
    previous_started_at_ms: int | None
    holder: str
    outcome: str | None
    finished_at_ms: int | None = None
    cursor: str | None = None  # where the passes have got to (the scrub's sha256)


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
        self.publish_times: dict[tuple[str, str], KnownTimes] = {}
        self.leases: dict[str, _Lease] = {}
        self.tombstones: dict[str, tuple[int, int]] = {}  # sha256 -> (size, at ms)
        self.job_history: dict[str, _JobRun] = {}
        self._order: dict[tuple[str, str], int] = {}  # insertion order (the SQL rowid)
        self._next_row = 0
        self._fence = 0
        self._job_locks: set[str] = set()
        self._listeners: list[Callable[[str, LeaseRow | None], None]] = []
        self._closed = False
        self.replica_rows: dict[str, Replica] = {}
        self.purges: list[Purge] = []
        self.failures: list[JobFailure] = []
        self.runs: dict[int, MirrorRun] = {}
        self.backfilled: set[str] = set()
        self.created_ms = clock.now_ms()

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

    async def pending_migrations(self) -> list[str] | None:
        await self._enter("pending_migrations")
        return []  # always the schema of today

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

    async def created_at_ms(self) -> int | None:
        await self._enter("created_at_ms")
        return self.created_ms

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

    # -- stored blobs ------------------------------------------------------------------------

    def _blobs(self) -> dict[str, int]:
        blobs: dict[str, int] = {}
        for entry in self.entries.values():
            if entry.sha256 is not None:
                blobs[entry.sha256] = max(blobs.get(entry.sha256, 0), entry.size)
        return blobs

    async def stored_blobs(self, after: str, limit: int) -> list[tuple[str, int]]:
        await self._enter("stored_blobs")
        return sorted(item for item in self._blobs().items() if item[0] > after)[:limit]

    async def stored_blob_totals(self) -> tuple[int, int]:
        await self._enter("stored_blob_totals")
        blobs = self._blobs()
        return len(blobs), sum(blobs.values())

    async def blob_entries(self, sha256: str, limit: int) -> list[tuple[str, str]]:
        await self._enter("blob_entries")
        named = [ident for ident, e in self.entries.items() if e.sha256 == sha256]
        return sorted(named, key=lambda i: (i[0].encode(), i[1].encode()))[:limit]

    async def delete_blob_entries(self, sha256: str) -> list[Removed]:
        await self._enter("delete_blob_entries")
        gone = [e for e in self.entries.values() if e.sha256 == sha256]
        for entry in gone:
            self._delete(entry)
        return [Removed(e.repository, e.key, e.sha256, e.size) for e in gone]

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

    # -- publish times ------------------------------------------------------------------

    async def record_first_sight(self, repository: str, keys_json: str, at_ms: int) -> str:
        await self._enter("record_first_sight")
        keys = json.loads(keys_json)
        for key in keys:
            self.publish_times.setdefault((repository, key), KnownTimes(at_ms))
        seen = {key: self.publish_times[(repository, key)].first_seen_ms for key in keys}
        return json.dumps(seen)

    async def known_times(self, repository: str, keys: Sequence[str]) -> dict[str, KnownTimes]:
        await self._enter("known_times")
        return {
            key: self.publish_times[(repository, key)]
            for key in keys
            if (repository, key) in self.publish_times
        }

    async def record_upstream_time(
        self, repository: str, key: str, upstream_ms: int, at_ms: int
    ) -> None:
        await self._enter("record_upstream_time")
        known = self.publish_times.get((repository, key), KnownTimes(at_ms))
        if known.upstream_ms is None:
            self.publish_times[(repository, key)] = KnownTimes(known.first_seen_ms, upstream_ms)

    # -- fetch leases --------------------------------------------------------------------------

    async def claim_lease(
        self,
        key: str,
        holder: str,
        ttl_s: float,
        unless_fresh: tuple[str, str, int] | None = None,
        unrenewed: tuple[int, float] | None = None,
    ) -> LeaseGrant | None:
        await self._enter("claim_lease")
        now = self._now()
        row = self.leases.get(key)
        if (
            row is not None
            and row.holder != holder
            and row.state == "fetching"
            and row.expires_at > now
            and unrenewed != (row.fence, float(row.renewed_at))
        ):
            return None
        if unless_fresh is not None:
            repository, entry_key, at_ms = unless_fresh
            entry = self.entries.get((repository, entry_key))
            if entry is not None and entry.is_fresh(at_ms):
                return None
        self._fence += 1  # a sequence: it grows on every claim and never goes back
        # (a new row: its stream, bytes written and waiters are cleared, as the SQL does)
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

    async def renew_lease(
        self,
        grant: LeaseGrant,
        ttl_s: float,
        written: int | None = None,
        waiters: int | None = None,
    ) -> bool:
        await self._enter("renew_lease")
        row = self._mandate(grant)
        if row is None:
            return False
        row.renewed_at = self._now()
        row.expires_at = row.renewed_at + int(ttl_s * 1000)
        row.written = written if written is not None else row.written
        row.waiters = waiters if waiters is not None else row.waiters
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
        return LeaseRow(
            key,
            row.holder,
            row.fence,
            row.state,
            expired,
            row.stream,
            remaining_s,
            float(row.renewed_at),
        )

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
        died = run.outcome == "running"  # under the lock: its pass died without an outcome
        if run.started_at_ms > now - int(interval_s * 1000) and not died:
            return None
        previous = run.previous_started_at_ms if died else run.started_at_ms
        self.job_history[name] = _JobRun(
            run.run_id + 1, now, previous, holder, "running", cursor=run.cursor
        )
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
                abandoned=run.outcome == "running" and name not in self._job_locks,
            )
            for name, run in sorted(self.job_history.items())
        ]
        return runs, self._now()

    async def job_cursor(self, name: str) -> str | None:
        await self._enter("job_cursor")
        run = self.job_history.get(name)
        return run.cursor if run is not None else None

    async def save_job_cursor(self, name: str, cursor: str | None) -> None:
        await self._enter("save_job_cursor")
        run = self.job_history.get(name)
        if run is not None:  # an UPDATE of the job's row, as in SQL
            run.cursor = cursor

    # -- browsing and purging ----------------------------------------------------------------

    def _of(self, repository: str) -> list[Entry]:
        return sorted(
            (e for (repo, _), e in self.entries.items() if repo == repository),
            key=lambda e: e.key.encode(),
        )

    async def browse_entries(
        self, repository: str, after_key: str, limit: int
    ) -> list[EntrySummary]:
        await self._enter("browse_entries")
        rows = [e for e in self._of(repository) if e.key.encode() > after_key.encode()]
        return [_summary(e) for e in rows[:limit]]

    async def search_entries(
        self, repository: str, prefix: str, after: tuple[str, str], limit: int
    ) -> list[EntrySummary]:
        await self._enter("search_entries")
        cursor = (after[0].encode(), after[1].encode())
        rows = sorted(
            (
                e
                for e in self._of(repository)
                if e.package is not None
                and e.package.startswith(prefix)
                and (e.package.encode(), e.key.encode()) > cursor
            ),
            key=lambda e: ((e.package or "").encode(), e.key.encode()),
        )
        return [_summary(e) for e in rows[:limit]]

    async def list_packages(
        self, repository: str, prefix: str, after: str, limit: int
    ) -> list[PackageSummary]:
        await self._enter("list_packages")
        grouped: dict[str, list[Entry]] = {}
        for entry in self._of(repository):
            name = entry.package
            if name is not None and name.startswith(prefix) and name.encode() > after.encode():
                grouped.setdefault(name, []).append(entry)
        found = []
        for name in sorted(grouped, key=str.encode)[:limit]:
            rows = grouped[name]
            versions = {e.version for e in rows if e.version is not None}
            found.append(
                PackageSummary(
                    name,
                    len(rows),
                    len(versions),
                    sum(e.size for e in rows),
                    max(e.last_access_ms for e in rows),
                )
            )
        return found

    async def package_entries(
        self, repository: str, package: str, limit: int
    ) -> list[EntrySummary]:
        await self._enter("package_entries")
        return [_summary(e) for e in self._of(repository) if e.package == package][:limit]

    async def delete_package(self, repository: str, package: str) -> list[Removed]:
        await self._enter("delete_package")
        gone = [e for e in self._of(repository) if e.package == package]
        for entry in gone:
            self._delete(entry)
        self._record_purge(repository, package, None)
        return [Removed(e.repository, e.key, e.sha256, e.size) for e in gone]

    async def purge_entry(self, repository: str, key: str) -> bool:
        await self._enter("purge_entry")
        entry = self.entries.get((repository, key))
        if entry is not None:
            self._delete(entry)
        self._record_purge(repository, None, key)
        return entry is not None

    def _record_purge(self, repository: str, package: str | None, key: str | None) -> None:
        self.purges.append(Purge(len(self.purges) + 1, repository, package, key))

    async def purges_after(self, purge_id: int) -> list[Purge]:
        await self._enter("purges_after")
        return [p for p in self.purges if p.id > purge_id][:1000]

    async def unpackaged_entries(self, repository: str, after_key: str, limit: int) -> list[str]:
        await self._enter("unpackaged_entries")
        return [
            e.key
            for e in self._of(repository)
            if e.package is None
            and e.kind is not Kind.HOSTED
            and e.key.encode() > after_key.encode()
        ][:limit]

    async def set_packages(
        self, repository: str, packages: dict[str, tuple[str, str | None]]
    ) -> None:
        await self._enter("set_packages")
        for key, (package, version) in packages.items():
            entry = self.entries.get((repository, key))
            if entry is not None and entry.package is None:
                self.entries[(repository, key)] = dataclasses.replace(
                    entry, package=package, version=version
                )

    async def backfilled_repositories(self) -> set[str]:
        await self._enter("backfilled_repositories")
        return set(self.backfilled)

    async def record_backfill(self, repository: str) -> None:
        await self._enter("record_backfill")
        self.backfilled.add(repository)

    # -- the fleet -----------------------------------------------------------------------------

    async def heartbeat(self, replica: Replica) -> int:
        await self._enter("heartbeat")
        now = self._now()
        old = self.replica_rows.get(replica.holder)
        self.replica_rows[replica.holder] = dataclasses.replace(
            replica,
            started_at_ms=old.started_at_ms if old is not None else replica.started_at_ms,
            seen_at_ms=now,
            stats=json.loads(json.dumps(replica.stats)),
        )
        return self.purges[-1].id if self.purges else 0

    async def replicas(self) -> list[Replica]:
        await self._enter("replicas")
        now = self._now()
        return [
            dataclasses.replace(r, now_ms=now)
            for r in sorted(self.replica_rows.values(), key=lambda r: r.started_at_ms)
        ]

    async def in_flight(self, limit: int) -> list[InFlight]:
        await self._enter("in_flight")
        now = self._now()
        live = [
            (key, row)
            for key, row in self.leases.items()
            if row.state == "fetching" and row.expires_at > now
        ]
        live.sort(key=lambda item: item[1].acquired_at)
        return [
            InFlight(
                key=key,
                holder=row.holder,
                fence=row.fence,
                acquired_at_ms=row.acquired_at,
                renewed_at_ms=row.renewed_at,
                written=row.written,
                length=row.stream.length if row.stream is not None else None,
                waiters=row.waiters,
                now_ms=now,
            )
            for key, row in live[:limit]
        ]

    async def forget_fleet_history(self, retention_s: float) -> int:
        await self._enter("forget_fleet_history")
        cutoff = self._now() - int(retention_s * 1000)
        gone = [h for h, r in self.replica_rows.items() if r.seen_at_ms < cutoff]
        for holder in gone:
            del self.replica_rows[holder]
        finished = [
            i
            for i, r in self.runs.items()
            if (r.finished_at_ms if r.finished_at_ms is not None else r.updated_at_ms) < cutoff
        ]
        for run_id in finished:
            del self.runs[run_id]
        return len(gone) + len(finished)

    # -- job failures and mirror runs ---------------------------------------------------------

    async def record_job_failure(self, name: str, run_id: int, holder: str, reason: str) -> None:
        await self._enter("record_job_failure")
        self.failures.append(JobFailure(name, run_id, holder, self._now(), reason))
        del self.failures[:-JOB_FAILURES_KEPT]

    async def job_failures(self, limit: int) -> list[JobFailure]:
        await self._enter("job_failures")
        return list(reversed(self.failures))[:limit]

    async def create_mirror_run(
        self, name: str, origin: str, holder: str, request: dict[str, Any]
    ) -> int:
        await self._enter("create_mirror_run")
        run_id = max(self.runs, default=0) + 1
        now = self._now()
        self.runs[run_id] = MirrorRun(
            run_id, name, origin, holder, json.loads(json.dumps(request)), "running", False,
            dict.fromkeys(MIRROR_COUNTS, 0), now, now, None, None, now,
        )  # fmt: skip
        return run_id

    async def update_mirror_run(self, run_id: int, counts: dict[str, int]) -> bool:
        await self._enter("update_mirror_run")
        run = self.runs.get(run_id)
        if run is None:
            return False
        self.runs[run_id] = dataclasses.replace(
            run, counts={c: int(counts.get(c, 0)) for c in MIRROR_COUNTS}, updated_at_ms=self._now()
        )
        return run.cancel_requested

    async def finish_mirror_run(
        self, run_id: int, state: str, counts: dict[str, int], error: str | None
    ) -> None:
        await self._enter("finish_mirror_run")
        run = self.runs.get(run_id)
        if run is None or run.state != "running":
            return
        now = self._now()
        self.runs[run_id] = dataclasses.replace(
            run,
            state=state,
            error=error,
            counts={c: int(counts.get(c, 0)) for c in MIRROR_COUNTS},
            finished_at_ms=now,
            updated_at_ms=now,
        )

    async def cancel_mirror_run(self, run_id: int) -> bool:
        await self._enter("cancel_mirror_run")
        run = self.runs.get(run_id)
        if run is None or run.state != "running":
            return False
        self.runs[run_id] = dataclasses.replace(run, cancel_requested=True)
        return True

    async def mirror_run(self, run_id: int) -> MirrorRun | None:
        await self._enter("mirror_run")
        run = self.runs.get(run_id)
        return dataclasses.replace(run, now_ms=self._now()) if run is not None else None

    async def mirror_runs(self, limit: int) -> list[MirrorRun]:
        await self._enter("mirror_runs")
        now = self._now()
        return [
            dataclasses.replace(self.runs[i], now_ms=now) for i in sorted(self.runs, reverse=True)
        ][:limit]


_PROXIED = (Kind.IMMUTABLE, Kind.METADATA)


def _summary(entry: Entry) -> EntrySummary:
    return EntrySummary(
        entry.key,
        entry.kind,
        entry.size,
        entry.package,
        entry.version,
        entry.fetched_at_ms,
        entry.last_access_ms,
    )


def _copy(entry: Entry) -> Entry:
    return dataclasses.replace(entry, digests=dict(entry.digests))

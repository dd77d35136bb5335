"""The catalog's operations, written once over named statements.

``SqlCatalog`` implements every ``Catalog`` method that is one statement (or one
statement after a dialect's prelude) by name; a backend subclass supplies the four
ways of running a statement, plus what the databases really do differently:
migrations, job locks and notifications. Because both backends run the same names
with the same parameters, they cannot drift apart in meaning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
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
    entry_from_row,
    entry_to_row,
    migration_files,
)
from proxy.catalog.queries import Queries
from proxy.clock import Clock
from proxy.runtime.blocking import run_blocking
from proxy.types import Kind, Link, LinkBatch

JOB_FAILURES_KEPT = 100


class SqlCatalog:
    backend: str
    queries: Queries
    migrations: Path  # this dialect's migration files
    # Statements run, in the claim's own write transaction, before claim_lease.
    CLAIM_PRELUDE: tuple[str, ...] = ()

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    # -- what a backend provides ------------------------------------------------------------

    async def _fetchrow(self, name: str, *args: Any) -> Any:
        """Run a read; its first row or None."""
        raise NotImplementedError

    async def _fetch(self, name: str, *args: Any) -> list[Any]:
        """Run a read; all its rows."""
        raise NotImplementedError

    async def _execute(self, name: str, *args: Any) -> int:
        """Run a write in its own transaction; the number of rows it touched."""
        raise NotImplementedError

    async def _write_returning(self, name: str, *args: Any, prelude: tuple[str, ...] = ()) -> Any:
        """Run ``prelude`` then a write with RETURNING, in one transaction; its row or None."""
        raise NotImplementedError

    async def _write_fetch(self, name: str, *args: Any) -> list[Any]:
        """Run a write with RETURNING in its own transaction; all its rows."""
        raise NotImplementedError

    # -- plumbing -------------------------------------------------------------------------

    async def ping(self) -> None:
        await self._fetchrow("ping")

    async def pending_migrations(self) -> list[str] | None:
        present = await self._fetchrow("migrations_table")
        done = (
            {row["version"] for row in await self._fetch("applied_migrations")}
            if present is not None and present["present"]
            else set()
        )
        if not done:
            return None
        return [
            name for version, name, _sql in migration_files(self.migrations) if version not in done
        ]

    # -- entries -------------------------------------------------------------------------

    async def get_entry(self, repository: str, key: str) -> Entry | None:
        row = await self._fetchrow("select_entry", repository, key)
        return entry_from_row(row) if row else None

    async def put_entry(self, entry: Entry) -> None:
        await self._execute("upsert_entry", *entry_to_row(entry))

    async def refresh_entry(self, entry: Entry) -> None:
        await self._execute(
            "refresh_entry",
            entry.fetched_at_ms,
            entry.expires_at_ms,
            entry.etag,
            entry.last_modified,
            entry.repository,
            entry.key,
            entry.sha256,
        )

    async def delete_entry(self, repository: str, key: str, sha256: str | None) -> bool:
        return await self._execute("delete_entry", repository, key, sha256) > 0

    async def touch_entries(self, accesses: Sequence[tuple[str, str, int]]) -> None:
        if accesses:
            batch = [{"repository": r, "key": k, "at": at} for r, k, at in accesses]
            await self._execute("touch_entries", json.dumps(batch))

    async def usage(self, repository: str) -> Usage:
        row = await self._fetchrow("usage", repository)
        return Usage(entries=int(row["entries"]), bytes=int(row["bytes"]))

    async def least_recently_used(self, repository: str, limit: int) -> list[Entry]:
        return [
            entry_from_row(row)
            for row in await self._fetch("least_recently_used", repository, limit)
        ]

    async def unreferenced_blobs(self, sha256s: Sequence[str]) -> set[str]:
        if not sha256s:
            return set()
        rows = await self._fetch("unreferenced_blobs", json.dumps(list(sha256s)))
        return {row["sha256"] for row in rows}

    async def created_at_ms(self) -> int | None:
        row = await self._fetchrow("created_at")
        return int(row["at_ms"]) if row is not None and row["at_ms"] is not None else None

    async def delete_expired_negatives(self, older_than_ms: int) -> int:
        return await self._execute("delete_expired_negatives", older_than_ms)

    # -- stored blobs (docs/architecture.md, "Blobs verified when read") -------------------

    async def stored_blobs(self, after: str, limit: int) -> list[tuple[str, int]]:
        rows = await self._fetch("stored_blobs", after, int(limit))
        return [(r["sha256"], int(r["size"])) for r in rows]

    async def stored_blob_totals(self) -> tuple[int, int]:
        row = await self._fetchrow("stored_blob_totals")
        return int(row["blobs"]), int(row["bytes"])

    async def blob_entries(self, sha256: str, limit: int) -> list[tuple[str, str]]:
        rows = await self._fetch("blob_entries", sha256, int(limit))
        return [(r["repository"], r["key"]) for r in rows]

    async def delete_blob_entries(self, sha256: str) -> list[Removed]:
        return [_removed(r) for r in await self._write_fetch("delete_blob_entries", sha256)]

    # -- eviction and retention (docs/architecture.md, "Eviction and retention") -----------

    async def storage_usage(self) -> StorageUsage:
        row = await self._fetchrow("storage_usage")
        return StorageUsage(
            proxied_entries=int(row["proxied_entries"]),
            proxied_bytes=int(row["proxied_bytes"]),
            hosted_bytes=int(row["hosted_bytes"]),
            tombstoned_bytes=int(row["tombstoned_bytes"]),
        )

    async def evict_lru(self, free_bytes: int, limit: int) -> list[Removed]:
        rows = await self._write_fetch("evict_lru", int(free_bytes), int(limit))
        return [_removed(r) for r in rows]

    async def expire_unused(self, repository: str, before_ms: int, limit: int) -> list[Removed]:
        rows = await self._write_fetch("expire_unused", repository, int(before_ms), int(limit))
        return [_removed(r) for r in rows]

    async def drop_referenced_tombstones(self) -> int:
        return await self._execute("drop_referenced_tombstones")

    async def due_tombstones(self, grace_s: float, after: str, limit: int) -> list[tuple[str, int]]:
        rows = await self._fetch("due_tombstones", float(grace_s), after, int(limit))
        return [(r["sha256"], int(r["size"])) for r in rows]

    async def forget_tombstones(self, sha256s: Sequence[str]) -> int:
        if not sha256s:
            return 0
        return await self._execute("forget_tombstones", json.dumps(list(sha256s)))

    # -- links ------------------------------------------------------------------------------

    async def put_links(self, links: Sequence[Link] | LinkBatch) -> None:
        if not isinstance(links, LinkBatch):
            # A project page can list 100,000 files: encode off the event loop.
            links = await run_blocking(LinkBatch.encode, links)
        if links.count:
            await self._execute("upsert_links", links.json_text, self.clock.now_ms())

    async def get_link(self, repository: str, key: str) -> Link | None:
        row = await self._fetchrow("select_link", repository, key)
        if row is None:
            return None
        return Link(
            repository=row["repository"],
            key=row["key"],
            url=row["url"],
            digests=json.loads(row["digests"]),
            size=row["size"],
        )

    # -- publish times -------------------------------------------------------------------

    async def record_first_sight(self, repository: str, keys_json: str, at_ms: int) -> str:
        await self._execute("record_first_seen", repository, keys_json, at_ms)
        row = await self._fetchrow("select_first_seen", repository, keys_json)
        seen: str = row["seen"]
        return seen

    async def known_times(self, repository: str, keys: Sequence[str]) -> dict[str, KnownTimes]:
        if not keys:
            return {}
        rows = await self._fetch("select_publish_times", repository, json.dumps(list(keys)))
        return {
            row["key"]: KnownTimes(int(row["first_seen_ms"]), _int_or_none(row["upstream_ms"]))
            for row in rows
        }

    async def record_upstream_time(
        self, repository: str, key: str, upstream_ms: int, at_ms: int
    ) -> None:
        await self._execute("record_upstream_time", repository, key, upstream_ms, at_ms)

    # -- fetch leases ------------------------------------------------------------------------

    async def claim_lease(
        self,
        key: str,
        holder: str,
        ttl_s: float,
        unless_fresh: tuple[str, str, int] | None = None,
        unrenewed: tuple[int, float] | None = None,
    ) -> LeaseGrant | None:
        repository, entry_key, now_ms = unless_fresh or (None, None, None)
        fence, renewed = unrenewed or (None, None)
        row = await self._write_returning(
            "claim_lease",
            key,
            holder,
            float(ttl_s),
            repository,
            entry_key,
            now_ms,
            fence,
            renewed,
            prelude=self.CLAIM_PRELUDE,
        )
        return LeaseGrant(key=key, holder=holder, fence=int(row["fence"])) if row else None

    async def renew_lease(
        self,
        grant: LeaseGrant,
        ttl_s: float,
        written: int | None = None,
        waiters: int | None = None,
    ) -> bool:
        touched = await self._execute(
            "renew_lease", grant.key, grant.holder, grant.fence, float(ttl_s), written, waiters
        )
        return touched == 1

    async def release_lease(self, grant: LeaseGrant, state: str) -> bool:
        touched = await self._execute("release_lease", grant.key, grant.holder, grant.fence, state)
        return touched == 1

    async def announce_stream(self, grant: LeaseGrant, stream: StreamInfo) -> bool:
        touched = await self._execute(
            "announce_stream",
            grant.key,
            grant.holder,
            grant.fence,
            stream.file,
            stream.content_type,
            stream.length,
            stream.relay,
            stream.token,
        )
        return touched == 1

    async def get_lease(self, key: str) -> LeaseRow | None:
        row = await self._fetchrow("select_lease", key)
        if row is None:
            return None
        stream = None
        if (row["stream_file"] or row["stream_relay"]) and row["stream_length"] is not None:
            stream = StreamInfo(
                row["stream_file"],
                row["stream_type"],
                int(row["stream_length"]),
                row["stream_relay"],
                row["stream_token"],
            )
        return LeaseRow(
            key=row["key"],
            holder=row["holder"],
            fence=int(row["fence"]),
            state=row["state"],
            expired=bool(row["expired"]),
            stream=stream,
            remaining_s=float(row["remaining_s"]),
            renewed=float(row["renewed"]),
        )

    async def purge_leases(self, retention_s: float) -> int:
        return await self._execute("purge_leases", float(retention_s))

    # -- job runs ------------------------------------------------------------------------------

    async def claim_job_run(self, name: str, interval_s: float, holder: str) -> int | None:
        row = await self._write_returning("claim_job_run", name, float(interval_s), holder)
        return int(row["run_id"]) if row else None

    async def give_back_job_run(self, name: str, run_id: int) -> None:
        await self._execute("give_back_job_run", name, run_id)

    async def finish_job_run(self, name: str, run_id: int, outcome: str) -> None:
        await self._execute("finish_job_run", name, run_id, outcome)

    async def job_runs(self) -> tuple[list[JobRun], int]:
        rows = await self._fetch("select_job_runs")
        if not rows:
            now = await self._fetchrow("select_clock")
            return [], int(now["now_ms"])
        runs = [
            JobRun(
                name=r["name"],
                run_id=int(r["run_id"]),
                started_at_ms=None if r["started_at_ms"] is None else int(r["started_at_ms"]),
                finished_at_ms=None if r["finished_at_ms"] is None else int(r["finished_at_ms"]),
                outcome=r["outcome"],
                holder=r["holder"],
                abandoned=bool(r["abandoned"]),
            )
            for r in rows
        ]
        return runs, int(rows[0]["now_ms"])

    async def job_cursor(self, name: str) -> str | None:
        row = await self._fetchrow("select_job_cursor", name)
        return row["cursor"] if row else None

    async def save_job_cursor(self, name: str, cursor: str | None) -> None:
        await self._execute("save_job_cursor", name, cursor)

    # -- browsing and purging -------------------------------------------------------------

    async def browse_entries(
        self, repository: str, after_key: str, limit: int
    ) -> list[EntrySummary]:
        rows = await self._fetch("browse_entries", repository, after_key, int(limit))
        return [_summary(r) for r in rows]

    async def search_entries(
        self, repository: str, prefix: str, after: tuple[str, str], limit: int
    ) -> list[EntrySummary]:
        rows = await self._fetch(
            "search_entries", repository, prefix, after[0], after[1], int(limit)
        )
        return [_summary(r) for r in rows]

    async def list_packages(
        self, repository: str, prefix: str, after: str, limit: int
    ) -> list[PackageSummary]:
        rows = await self._fetch("list_packages", repository, prefix, after, int(limit))
        return [
            PackageSummary(
                package=r["package"],
                entries=int(r["entries"]),
                versions=int(r["versions"]),
                bytes=int(r["bytes"]),
                last_access_ms=int(r["last_access_ms"]),
            )
            for r in rows
        ]

    async def package_entries(
        self, repository: str, package: str, limit: int
    ) -> list[EntrySummary]:
        rows = await self._fetch("package_entries", repository, package, int(limit))
        return [_summary(r) for r in rows]

    async def delete_package(self, repository: str, package: str) -> list[Removed]:
        rows = await self._write_fetch("delete_package", repository, package)
        await self._execute("record_purge", repository, package, None)
        return [_removed(r) for r in rows]

    async def purge_entry(self, repository: str, key: str) -> bool:
        deleted = await self._execute("delete_entry", repository, key, None) > 0
        await self._execute("record_purge", repository, None, key)
        return deleted

    async def purges_after(self, purge_id: int) -> list[Purge]:
        rows = await self._fetch("purges_after", int(purge_id))
        return [Purge(int(r["id"]), r["repository"], r["package"], r["key"]) for r in rows]

    async def unpackaged_entries(self, repository: str, after_key: str, limit: int) -> list[str]:
        rows = await self._fetch("unpackaged_entries", repository, after_key, int(limit))
        return [r["key"] for r in rows]

    async def set_packages(
        self, repository: str, packages: dict[str, tuple[str, str | None]]
    ) -> None:
        if packages:
            batch = [
                {"repository": repository, "key": key, "package": package, "version": version}
                for key, (package, version) in packages.items()
            ]
            await self._execute("set_packages", json.dumps(batch))

    async def backfilled_repositories(self) -> set[str]:
        return {r["repository"] for r in await self._fetch("select_backfills")}

    async def record_backfill(self, repository: str) -> None:
        await self._execute("record_backfill", repository)

    # -- the fleet -------------------------------------------------------------------------

    async def heartbeat(self, replica: Replica) -> int:
        row = await self._write_returning(
            "heartbeat",
            replica.holder,
            replica.host,
            int(replica.pid),
            replica.url,
            replica.version,
            int(replica.started_at_ms),
            json.dumps(replica.stats),
        )
        return int(row["newest_purge"]) if row else 0

    async def replicas(self) -> list[Replica]:
        rows = await self._fetch("select_replicas")
        return [
            Replica(
                holder=r["holder"],
                host=r["host"],
                pid=int(r["pid"]),
                url=r["url"],
                version=r["version"],
                started_at_ms=int(r["started_at_ms"]),
                seen_at_ms=int(r["seen_at_ms"]),
                stats=json.loads(r["stats"]),
                now_ms=int(r["now_ms"]),
            )
            for r in rows
        ]

    async def in_flight(self, limit: int) -> list[InFlight]:
        rows = await self._fetch("in_flight", int(limit))
        return [
            InFlight(
                key=r["key"],
                holder=r["holder"],
                fence=int(r["fence"]),
                acquired_at_ms=int(r["acquired_at_ms"]),
                renewed_at_ms=int(r["renewed_at_ms"]),
                written=_int_or_none(r["written"]),
                length=_int_or_none(r["stream_length"]),
                waiters=_int_or_none(r["waiters"]),
                now_ms=int(r["now_ms"]),
            )
            for r in rows
        ]

    async def forget_fleet_history(self, retention_s: float) -> int:
        forgotten = 0
        for name in ("forget_replicas", "forget_purges", "forget_mirror_runs"):
            forgotten += await self._execute(name, float(retention_s))
        return forgotten

    # -- job failures and mirror runs ------------------------------------------------------

    async def record_job_failure(self, name: str, run_id: int, holder: str, reason: str) -> None:
        await self._execute("record_job_failure", name, int(run_id), holder, reason)
        await self._execute("trim_job_failures", JOB_FAILURES_KEPT)

    async def job_failures(self, limit: int) -> list[JobFailure]:
        rows = await self._fetch("select_job_failures", int(limit))
        return [
            JobFailure(r["name"], int(r["run_id"]), r["holder"], int(r["at_ms"]), r["reason"])
            for r in rows
        ]

    async def create_mirror_run(
        self, name: str, origin: str, holder: str, request: dict[str, Any]
    ) -> int:
        row = await self._write_returning(
            "create_mirror_run", name, origin, holder, json.dumps(request)
        )
        return int(row["id"])

    async def update_mirror_run(self, run_id: int, counts: dict[str, int]) -> bool:
        row = await self._write_returning(
            "update_mirror_run", int(run_id), *(int(counts.get(c, 0)) for c in MIRROR_COUNTS)
        )
        return bool(row["cancel_requested"]) if row else False

    async def finish_mirror_run(
        self, run_id: int, state: str, counts: dict[str, int], error: str | None
    ) -> None:
        await self._execute(
            "finish_mirror_run",
            int(run_id),
            state,
            error,
            *(int(counts.get(c, 0)) for c in MIRROR_COUNTS),
        )

    async def cancel_mirror_run(self, run_id: int) -> bool:
        return await self._execute("cancel_mirror_run", int(run_id)) > 0

    async def mirror_run(self, run_id: int) -> MirrorRun | None:
        row = await self._fetchrow("select_mirror_run", int(run_id))
        return _mirror_run(row) if row else None

    async def mirror_runs(self, limit: int) -> list[MirrorRun]:
        return [_mirror_run(r) for r in await self._fetch("select_mirror_runs", int(limit))]


def _removed(row: Any) -> Removed:
    return Removed(
        repository=row["repository"], key=row["key"], sha256=row["sha256"], size=int(row["size"])
    )


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _summary(row: Any) -> EntrySummary:
    return EntrySummary(
        key=row["key"],
        kind=Kind(row["kind"]),
        size=int(row["size"]),
        package=row["package"],
        version=row["version"],
        fetched_at_ms=int(row["fetched_at_ms"]),
        last_access_ms=int(row["last_access_ms"]),
    )


def _mirror_run(row: Any) -> MirrorRun:
    return MirrorRun(
        id=int(row["id"]),
        name=row["name"],
        origin=row["origin"],
        holder=row["holder"],
        request=json.loads(row["request"]),
        state=row["state"],
        cancel_requested=bool(row["cancel_requested"]),
        counts={name: int(row[name]) for name in MIRROR_COUNTS},
        started_at_ms=int(row["started_at_ms"]),
        updated_at_ms=int(row["updated_at_ms"]),
        finished_at_ms=_int_or_none(row["finished_at_ms"]),
        error=row["error"],
        now_ms=int(row["now_ms"]),
    )

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
from typing import Any

from proxy.catalog import (
    Entry,
    JobRun,
    LeaseGrant,
    LeaseRow,
    Removed,
    StorageUsage,
    StreamInfo,
    Usage,
    entry_from_row,
    entry_to_row,
)
from proxy.catalog.queries import Queries
from proxy.clock import Clock
from proxy.runtime.blocking import run_blocking
from proxy.types import Link, LinkBatch


class SqlCatalog:
    backend: str
    queries: Queries
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

    async def delete_expired_negatives(self, older_than_ms: int) -> int:
        return await self._execute("delete_expired_negatives", older_than_ms)

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

    # -- fetch leases ------------------------------------------------------------------------

    async def claim_lease(
        self,
        key: str,
        holder: str,
        ttl_s: float,
        unless_fresh: tuple[str, str, int] | None = None,
    ) -> LeaseGrant | None:
        repository, entry_key, now_ms = unless_fresh or (None, None, None)
        row = await self._write_returning(
            "claim_lease",
            key,
            holder,
            float(ttl_s),
            repository,
            entry_key,
            now_ms,
            prelude=self.CLAIM_PRELUDE,
        )
        return LeaseGrant(key=key, holder=holder, fence=int(row["fence"])) if row else None

    async def renew_lease(self, grant: LeaseGrant, ttl_s: float) -> bool:
        touched = await self._execute(
            "renew_lease", grant.key, grant.holder, grant.fence, float(ttl_s)
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
        )
        return touched == 1

    async def get_lease(self, key: str) -> LeaseRow | None:
        row = await self._fetchrow("select_lease", key)
        if row is None:
            return None
        stream = None
        if row["stream_file"] and row["stream_length"] is not None:
            stream = StreamInfo(row["stream_file"], row["stream_type"], int(row["stream_length"]))
        return LeaseRow(
            key=row["key"],
            holder=row["holder"],
            fence=int(row["fence"]),
            state=row["state"],
            expired=bool(row["expired"]),
            stream=stream,
            remaining_s=float(row["remaining_s"]),
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
            )
            for r in rows
        ]
        return runs, int(rows[0]["now_ms"])


def _removed(row: Any) -> Removed:
    return Removed(
        repository=row["repository"], key=row["key"], sha256=row["sha256"], size=int(row["size"])
    )

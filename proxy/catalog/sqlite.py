"""The embedded catalog: one SQLite file (WAL), one connection per process.

Every statement runs on one dedicated thread, so the event loop never waits on the
disk and statements of one process never interleave. Several processes (``--workers``)
share the file; SQLite's write lock serializes their transactions, which is what makes
the lease claim atomic here. Times are Unix milliseconds from this machine's clock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

from proxy.catalog import (
    Entry,
    LeaseGrant,
    LeaseRow,
    Link,
    Usage,
    entry_from_row,
    entry_to_row,
    migration_files,
    now_ms,
)
from proxy.exceptions import CatalogError

T = TypeVar("T")
log = logging.getLogger("proxy.catalog")

BUSY_TIMEOUT_MS = 15_000
JOB_LOCK_TTL_MS = 3_600_000  # a crashed holder's job lock frees itself after this

CREATE_SCHEMA_MIGRATIONS = """
CREATE TABLE IF NOT EXISTS schema_migrations
    (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)
"""
ENTRY_COLUMNS = (
    "repository, key, kind, sha256, size, content_type, etag, last_modified, digests, "
    "fetched_at_ms, expires_at_ms, last_access_ms"
)
SELECT_ENTRY = f"SELECT {ENTRY_COLUMNS} FROM entries WHERE repository = ? AND key = ?"
UPSERT_ENTRY = f"""
INSERT INTO entries ({ENTRY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (repository, key) DO UPDATE SET
    kind = excluded.kind, sha256 = excluded.sha256, size = excluded.size,
    content_type = excluded.content_type, etag = excluded.etag,
    last_modified = excluded.last_modified, digests = excluded.digests,
    fetched_at_ms = excluded.fetched_at_ms, expires_at_ms = excluded.expires_at_ms,
    last_access_ms = max(entries.last_access_ms, excluded.last_access_ms)
"""
REFRESH_ENTRY = """
UPDATE entries SET fetched_at_ms = ?, expires_at_ms = ?, etag = ?, last_modified = ?
WHERE repository = ? AND key = ? AND sha256 IS ?
"""
DELETE_ENTRY = "DELETE FROM entries WHERE repository = ? AND key = ? AND (? IS NULL OR sha256 = ?)"
TOUCH_ENTRY = """
UPDATE entries SET last_access_ms = max(last_access_ms, ?) WHERE repository = ? AND key = ?
"""
USAGE = "SELECT count(*), coalesce(sum(size), 0) FROM entries WHERE repository = ?"
LEAST_RECENTLY_USED = f"""
SELECT {ENTRY_COLUMNS} FROM entries WHERE repository = ? AND kind <> 'negative'
ORDER BY last_access_ms LIMIT ?
"""
BLOB_REFERENCED = "SELECT 1 FROM entries WHERE sha256 = ? LIMIT 1"
DELETE_EXPIRED_NEGATIVES = "DELETE FROM entries WHERE kind = 'negative' AND expires_at_ms < ?"

UPSERT_LINK = """
INSERT INTO links (repository, key, url, digests, size, recorded_at_ms) VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (repository, key) DO UPDATE SET
    url = excluded.url, digests = excluded.digests, size = excluded.size,
    recorded_at_ms = excluded.recorded_at_ms
"""
SELECT_LINK = (
    "SELECT repository, key, url, digests, size FROM links WHERE repository = ? AND key = ?"
)

NEXT_FENCE = "INSERT INTO lease_fences DEFAULT VALUES"
TRIM_FENCES = "DELETE FROM lease_fences WHERE id < ?"
CLAIM_LEASE = """
INSERT INTO fetch_leases (key, holder, fence, state, acquired_at, renewed_at, expires_at)
VALUES (?, ?, ?, 'fetching', ?, ?, ?)
ON CONFLICT (key) DO UPDATE SET
    holder = excluded.holder, fence = excluded.fence, state = 'fetching',
    acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at,
    expires_at = excluded.expires_at
WHERE fetch_leases.holder = excluded.holder
   OR fetch_leases.state <> 'fetching'
   OR fetch_leases.expires_at <= ?
RETURNING fence
"""
RENEW_LEASE = """
UPDATE fetch_leases SET renewed_at = ?, expires_at = ?
WHERE key = ? AND holder = ? AND fence = ? AND state = 'fetching'
"""
RELEASE_LEASE = """
UPDATE fetch_leases SET state = ?, expires_at = max(?, acquired_at)
WHERE key = ? AND holder = ? AND fence = ? AND state = 'fetching'
"""
SELECT_LEASE = "SELECT key, holder, fence, state, expires_at <= ? FROM fetch_leases WHERE key = ?"
PURGE_LEASES = "DELETE FROM fetch_leases WHERE expires_at < ?"

CLAIM_JOB_LOCK = """
INSERT INTO job_locks (name, holder, expires_at_ms) VALUES (?, ?, ?)
ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_at_ms = excluded.expires_at_ms
WHERE job_locks.expires_at_ms <= ?
RETURNING name
"""
RELEASE_JOB_LOCK = "DELETE FROM job_locks WHERE name = ? AND holder = ?"
CLAIM_JOB_RUN = """
INSERT INTO job_runs (name, run_id, started_at_ms, previous_started_at_ms, holder)
VALUES (?, 1, ?, NULL, ?)
ON CONFLICT (name) DO UPDATE SET
    run_id = job_runs.run_id + 1, previous_started_at_ms = job_runs.started_at_ms,
    started_at_ms = excluded.started_at_ms, holder = excluded.holder
WHERE job_runs.started_at_ms <= ?
RETURNING run_id
"""
GIVE_BACK_JOB_RUN = """
UPDATE job_runs SET started_at_ms = coalesce(previous_started_at_ms, 0)
WHERE name = ? AND run_id = ?
"""


class SqliteCatalog:
    backend = "sqlite"

    def __init__(self, path: Path, migrations: Path) -> None:
        self.path = path
        self.migrations = migrations
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")
        self._conn: sqlite3.Connection | None = None
        # Unique per process and instance: workers share the file and its job locks.
        self.job_holder = f"{os.getpid()}:{uuid.uuid4().hex[:8]}"

    # -- plumbing -------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=BUSY_TIMEOUT_MS / 1000,
            )
            conn.execute("PRAGMA journal_mode = WAL")
            # FULL: an acknowledged build-cache PUT must survive a power cut.
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._conn = conn
        return self._conn

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            try:
                return fn(self._connect())
            except sqlite3.Error as exc:
                raise CatalogError(f"sqlite {self.path}: {exc}") from exc

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one write transaction (BEGIN IMMEDIATE takes the write lock up front)."""

        def tx(conn: sqlite3.Connection) -> T:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return result

        return await self._run(tx)

    async def migrate(self) -> list[str]:
        files = migration_files(self.migrations)

        def apply(conn: sqlite3.Connection) -> list[str]:
            # EXCLUSIVE: workers started together apply the schema once, one after another.
            conn.execute("BEGIN EXCLUSIVE")
            try:
                conn.execute(CREATE_SCHEMA_MIGRATIONS)
                done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
                applied = []
                for version, name, sql in files:
                    if version in done:
                        continue
                    for statement in _split_sql(sql):
                        conn.execute(statement)
                    conn.execute(
                        "INSERT INTO schema_migrations VALUES (?, ?, ?)", (version, name, now_ms())
                    )
                    applied.append(name)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return applied

        return await self._run(apply)

    async def close(self) -> None:
        def close(conn: sqlite3.Connection) -> None:
            conn.close()
            self._conn = None

        if self._conn is not None:
            await self._run(close)
        self._executor.shutdown(wait=True)

    async def ping(self) -> None:
        await self._run(lambda conn: conn.execute("SELECT 1").fetchone())

    # -- entries -------------------------------------------------------------------

    async def get_entry(self, repository: str, key: str) -> Entry | None:
        row = await self._run(lambda c: c.execute(SELECT_ENTRY, (repository, key)).fetchone())
        return entry_from_row(row) if row else None

    async def put_entry(self, entry: Entry) -> None:
        await self._write(lambda c: c.execute(UPSERT_ENTRY, entry_to_row(entry)))

    async def refresh_entry(self, entry: Entry) -> None:
        params = (
            entry.fetched_at_ms,
            entry.expires_at_ms,
            entry.etag,
            entry.last_modified,
            entry.repository,
            entry.key,
            entry.sha256,
        )
        await self._write(lambda c: c.execute(REFRESH_ENTRY, params))

    async def delete_entry(self, repository: str, key: str, sha256: str | None) -> bool:
        params = (repository, key, sha256, sha256)
        return await self._write(lambda c: c.execute(DELETE_ENTRY, params).rowcount > 0)

    async def touch_entries(self, accesses: Sequence[tuple[str, str, int]]) -> None:
        params = [(at, repo, key) for repo, key, at in accesses]
        await self._write(lambda c: c.executemany(TOUCH_ENTRY, params))

    async def usage(self, repository: str) -> Usage:
        count, total = await self._run(lambda c: c.execute(USAGE, (repository,)).fetchone())
        return Usage(entries=count, bytes=total)

    async def least_recently_used(self, repository: str, limit: int) -> list[Entry]:
        rows = await self._run(
            lambda c: c.execute(LEAST_RECENTLY_USED, (repository, limit)).fetchall()
        )
        return [entry_from_row(row) for row in rows]

    async def blob_is_referenced(self, sha256: str) -> bool:
        row = await self._run(lambda c: c.execute(BLOB_REFERENCED, (sha256,)).fetchone())
        return row is not None

    async def delete_expired_negatives(self, older_than_ms: int) -> int:
        return await self._write(
            lambda c: c.execute(DELETE_EXPIRED_NEGATIVES, (older_than_ms,)).rowcount
        )

    # -- links ---------------------------------------------------------------------

    async def put_links(self, links: Sequence[Link]) -> None:
        at = now_ms()
        params = [
            (link.repository, link.key, link.url, json.dumps(link.digests), link.size, at)
            for link in links
        ]
        if params:
            await self._write(lambda c: c.executemany(UPSERT_LINK, params))

    async def get_link(self, repository: str, key: str) -> Link | None:
        row = await self._run(lambda c: c.execute(SELECT_LINK, (repository, key)).fetchone())
        if row is None:
            return None
        return Link(row[0], row[1], row[2], json.loads(row[3]), row[4])

    # -- fetch leases -------------------------------------------------------------------

    async def claim_lease(self, key: str, holder: str, ttl_s: float) -> LeaseGrant | None:
        ttl_ms = int(ttl_s * 1000)

        def claim(conn: sqlite3.Connection) -> int | None:
            now = now_ms()
            fence = conn.execute(NEXT_FENCE).lastrowid
            assert fence is not None
            conn.execute(TRIM_FENCES, (fence,))
            row = conn.execute(
                CLAIM_LEASE, (key, holder, fence, now, now, now + ttl_ms, now)
            ).fetchone()
            return int(row[0]) if row else None

        fence = await self._write(claim)
        return LeaseGrant(key=key, holder=holder, fence=fence) if fence is not None else None

    async def renew_lease(self, grant: LeaseGrant, ttl_s: float) -> bool:
        def renew(conn: sqlite3.Connection) -> bool:
            now = now_ms()
            params = (now, now + int(ttl_s * 1000), grant.key, grant.holder, grant.fence)
            return conn.execute(RENEW_LEASE, params).rowcount == 1

        return await self._write(renew)

    async def release_lease(self, grant: LeaseGrant, state: str) -> bool:
        def release(conn: sqlite3.Connection) -> bool:
            params = (state, now_ms(), grant.key, grant.holder, grant.fence)
            return conn.execute(RELEASE_LEASE, params).rowcount == 1

        return await self._write(release)

    async def get_lease(self, key: str) -> LeaseRow | None:
        row = await self._run(lambda c: c.execute(SELECT_LEASE, (now_ms(), key)).fetchone())
        if row is None:
            return None
        return LeaseRow(key=row[0], holder=row[1], fence=row[2], state=row[3], expired=bool(row[4]))

    async def purge_leases(self, retention_s: float) -> int:
        cutoff = now_ms() - int(retention_s * 1000)
        return await self._write(lambda c: c.execute(PURGE_LEASES, (cutoff,)).rowcount)

    # -- jobs ------------------------------------------------------------------------

    @asynccontextmanager
    async def job_lock(self, name: str) -> AsyncIterator[bool]:
        def claim(conn: sqlite3.Connection) -> bool:
            now = now_ms()
            params = (name, self.job_holder, now + JOB_LOCK_TTL_MS, now)
            return conn.execute(CLAIM_JOB_LOCK, params).fetchone() is not None

        acquired = await self._write(claim)
        try:
            yield acquired
        finally:
            if acquired:
                try:
                    await self._write(
                        lambda c: c.execute(RELEASE_JOB_LOCK, (name, self.job_holder))
                    )
                except CatalogError as exc:
                    # Expires by itself (JOB_LOCK_TTL_MS); must not mask the pass's outcome.
                    log.warning("job %s: unlock failed: %s", name, exc)

    async def claim_job_run(self, name: str, interval_s: float, holder: str) -> int | None:
        def claim(conn: sqlite3.Connection) -> int | None:
            now = now_ms()
            params = (name, now, holder, now - int(interval_s * 1000))
            row = conn.execute(CLAIM_JOB_RUN, params).fetchone()
            return int(row[0]) if row else None

        return await self._write(claim)

    async def give_back_job_run(self, name: str, run_id: int) -> None:
        await self._write(lambda c: c.execute(GIVE_BACK_JOB_RUN, (name, run_id)))

    async def listen_leases(self, on_notify: Callable[[str], None]) -> None:
        # SQLite has no notifications: waiters poll. Stay parked until cancelled.
        await asyncio.Event().wait()


def _split_sql(sql: str) -> list[str]:
    """Statements of a migration file (no semicolons inside our statements' literals)."""
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return [stmt.strip() for stmt in "\n".join(lines).split(";") if stmt.strip()]

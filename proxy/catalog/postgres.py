"""The fleet catalog: Postgres through an asyncpg pool.

Lease statements use ``clock_timestamp()`` (never ``now()``, which is the start of the
transaction), so the database clock is the only clock leases depend on. Migrations run
in one transaction under an advisory lock, so replicas started together on an empty
database all come up and the schema is applied once. Lease transitions are announced
with NOTIFY by a trigger; ``listen_leases`` keeps a dedicated connection listening and
reconnects when it drops.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import asyncpg

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

log = logging.getLogger("proxy.catalog")

POOL_MIN_SIZE = 1
POOL_MAX_SIZE = 20
COMMAND_TIMEOUT_S = 10.0
ACQUIRE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
LISTENER_RETRY_MAX_S = 5.0
NOTIFY_CHANNEL = "proxy_fetch_leases"
LISTENER_APPLICATION_NAME = "proxy-lease-listener"
MIGRATION_LOCK_KEY = 0x70726F7879  # "proxy": one fleet-wide lock for schema changes

ENTRY_COLUMNS = (
    "repository, key, kind, sha256, size, content_type, etag, last_modified, digests::text, "
    "fetched_at_ms, expires_at_ms, last_access_ms"
)
SELECT_ENTRY = f"SELECT {ENTRY_COLUMNS} FROM entries WHERE repository = $1 AND key = $2"
UPSERT_ENTRY = """
INSERT INTO entries (repository, key, kind, sha256, size, content_type, etag, last_modified,
                     digests, fetched_at_ms, expires_at_ms, last_access_ms)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12)
ON CONFLICT (repository, key) DO UPDATE SET
    kind = EXCLUDED.kind, sha256 = EXCLUDED.sha256, size = EXCLUDED.size,
    content_type = EXCLUDED.content_type, etag = EXCLUDED.etag,
    last_modified = EXCLUDED.last_modified, digests = EXCLUDED.digests,
    fetched_at_ms = EXCLUDED.fetched_at_ms, expires_at_ms = EXCLUDED.expires_at_ms,
    last_access_ms = greatest(entries.last_access_ms, EXCLUDED.last_access_ms)
"""
REFRESH_ENTRY = """
UPDATE entries SET fetched_at_ms = $1, expires_at_ms = $2, etag = $3, last_modified = $4
WHERE repository = $5 AND key = $6 AND sha256 IS NOT DISTINCT FROM $7
"""
DELETE_ENTRY = """
DELETE FROM entries WHERE repository = $1 AND key = $2 AND ($3::text IS NULL OR sha256 = $3)
"""
TOUCH_ENTRIES = """
UPDATE entries AS e SET last_access_ms = greatest(e.last_access_ms, t.at)
FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t(repository, key, at)
WHERE e.repository = t.repository AND e.key = t.key
"""
USAGE = "SELECT count(*), coalesce(sum(size), 0) FROM entries WHERE repository = $1"
LEAST_RECENTLY_USED = f"""
SELECT {ENTRY_COLUMNS} FROM entries WHERE repository = $1 AND kind <> 'negative'
ORDER BY last_access_ms LIMIT $2
"""
BLOB_REFERENCED = "SELECT EXISTS (SELECT 1 FROM entries WHERE sha256 = $1)"
DELETE_EXPIRED_NEGATIVES = "DELETE FROM entries WHERE kind = 'negative' AND expires_at_ms < $1"

UPSERT_LINKS = """
INSERT INTO links (repository, key, url, digests, size, recorded_at_ms)
SELECT t.repository, t.key, t.url, t.digests::jsonb, t.size, $6
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[])
    AS t(repository, key, url, digests, size)
ON CONFLICT (repository, key) DO UPDATE SET
    url = EXCLUDED.url, digests = EXCLUDED.digests, size = EXCLUDED.size,
    recorded_at_ms = EXCLUDED.recorded_at_ms
"""
SELECT_LINK = """
SELECT repository, key, url, digests::text, size FROM links WHERE repository = $1 AND key = $2
"""

# acquired_at and expires_at come from the proposed row, evaluated before any wait for
# the row lock, so a claim that waited long cannot violate the CHECK.
CLAIM_LEASE = """
INSERT INTO fetch_leases AS l (key, holder, fence, state, acquired_at, renewed_at, expires_at)
VALUES ($1, $2, nextval('fetch_lease_fence'), 'fetching',
        clock_timestamp(), clock_timestamp(), clock_timestamp() + make_interval(secs => $3))
ON CONFLICT (key) DO UPDATE SET
    holder = EXCLUDED.holder, fence = EXCLUDED.fence, state = 'fetching',
    acquired_at = EXCLUDED.acquired_at, renewed_at = EXCLUDED.renewed_at,
    expires_at = EXCLUDED.expires_at
WHERE l.holder = EXCLUDED.holder OR l.state <> 'fetching' OR l.expires_at <= clock_timestamp()
RETURNING fence
"""
RENEW_LEASE = """
UPDATE fetch_leases
SET renewed_at = clock_timestamp(), expires_at = clock_timestamp() + make_interval(secs => $4)
WHERE key = $1 AND holder = $2 AND fence = $3 AND state = 'fetching'
"""
RELEASE_LEASE = """
UPDATE fetch_leases SET state = $4, expires_at = greatest(clock_timestamp(), acquired_at)
WHERE key = $1 AND holder = $2 AND fence = $3 AND state = 'fetching'
"""
SELECT_LEASE = """
SELECT key, holder, fence, state, expires_at <= clock_timestamp() FROM fetch_leases WHERE key = $1
"""
PURGE_LEASES = """
DELETE FROM fetch_leases WHERE expires_at < clock_timestamp() - make_interval(secs => $1)
"""

TRY_JOB_LOCK = "SELECT pg_try_advisory_lock(hashtext('proxy-job:' || $1))"
UNLOCK_JOB = "SELECT pg_advisory_unlock(hashtext('proxy-job:' || $1))"
CLAIM_JOB_RUN = """
INSERT INTO job_runs (name, run_id, started_at, previous_started_at, holder)
VALUES ($1, 1, clock_timestamp(), NULL, $3)
ON CONFLICT (name) DO UPDATE SET
    run_id = job_runs.run_id + 1, previous_started_at = job_runs.started_at,
    started_at = EXCLUDED.started_at, holder = EXCLUDED.holder
WHERE job_runs.started_at <= clock_timestamp() - make_interval(secs => $2)
RETURNING run_id
"""
GIVE_BACK_JOB_RUN = """
UPDATE job_runs SET started_at = coalesce(previous_started_at, '-infinity')
WHERE name = $1 AND run_id = $2
"""
CREATE_SCHEMA_MIGRATIONS = """
CREATE TABLE IF NOT EXISTS schema_migrations
    (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL)
"""

_DRIVER_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)
_CONNECTION_LOST = (
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    asyncpg.AdminShutdownError,
    asyncpg.CannotConnectNowError,
    ConnectionError,
)


@contextmanager
def _translated(operation: str) -> Iterator[None]:
    try:
        yield
    except _DRIVER_ERRORS as exc:
        raise CatalogError(f"postgres {operation}: {type(exc).__name__}: {exc}") from exc


class PostgresCatalog:
    backend = "postgres"

    def __init__(self, dsn: str, migrations: Path) -> None:
        self.dsn = dsn
        self.migrations = migrations
        self._pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()
        self._closed = False

    async def _get_pool(self) -> asyncpg.Pool:
        if self._closed:
            raise CatalogError("postgres: the catalog is closed")
        if self._pool is None:
            async with self._pool_lock:
                if self._pool is None:
                    with _translated("connect"):
                        self._pool = await asyncpg.create_pool(
                            self.dsn,
                            min_size=POOL_MIN_SIZE,
                            max_size=POOL_MAX_SIZE,
                            command_timeout=COMMAND_TIMEOUT_S,
                            timeout=CONNECT_TIMEOUT_S,
                            server_settings={"application_name": "proxy"},
                        )
        return self._pool

    @asynccontextmanager
    async def _connection(self, operation: str) -> AsyncIterator[asyncpg.Connection]:
        pool = await self._get_pool()
        with _translated(operation):
            async with pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn:
                yield conn

    async def _call(self, operation: str, method: str, sql: str, *args: Any) -> Any:
        """Run one statement; once more on a fresh connection if the pooled one was dead.

        After a database restart every pooled connection is broken; the retry spares
        the first request after the restart an error. Our statements are safe to
        repeat (a repeated claim is a re-entrant claim by the same holder).
        """
        for attempt in (1, 2):
            try:
                async with self._connection(operation) as conn:
                    return await getattr(conn, method)(sql, *args)
            except CatalogError as exc:
                dead = isinstance(exc.__cause__, _CONNECTION_LOST)
                if attempt == 2 or not dead:
                    raise
        raise AssertionError("unreachable")

    async def _fetchrow(self, operation: str, sql: str, *args: Any) -> Any:
        return await self._call(operation, "fetchrow", sql, *args)

    async def _fetch(self, operation: str, sql: str, *args: Any) -> list[Any]:
        return list(await self._call(operation, "fetch", sql, *args))

    async def _execute(self, operation: str, sql: str, *args: Any) -> int:
        """Run a statement; returns the number of rows it touched."""
        status: str = await self._call(operation, "execute", sql, *args)
        tail = status.rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    async def migrate(self) -> list[str]:
        files = migration_files(self.migrations)
        async with self._connection("migrate") as conn, conn.transaction():
            # Transaction-scoped: released by the commit, even if this process dies.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK_KEY)
            await conn.execute(CREATE_SCHEMA_MIGRATIONS)
            done = {row[0] for row in await conn.fetch("SELECT version FROM schema_migrations")}
            applied = []
            for version, name, sql in files:
                if version in done:
                    continue
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO schema_migrations VALUES ($1, $2, clock_timestamp())",
                    version,
                    name,
                )
                applied.append(name)
        return applied

    async def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            try:
                await asyncio.wait_for(self._pool.close(), timeout=5)
            except (TimeoutError, *_DRIVER_ERRORS):
                self._pool.terminate()
            self._pool = None

    async def ping(self) -> None:
        await self._fetchrow("ping", "SELECT 1")

    # -- entries -------------------------------------------------------------------

    async def get_entry(self, repository: str, key: str) -> Entry | None:
        row = await self._fetchrow("get_entry", SELECT_ENTRY, repository, key)
        return entry_from_row(row) if row else None

    async def put_entry(self, entry: Entry) -> None:
        await self._execute("put_entry", UPSERT_ENTRY, *entry_to_row(entry))

    async def refresh_entry(self, entry: Entry) -> None:
        await self._execute(
            "refresh_entry",
            REFRESH_ENTRY,
            entry.fetched_at_ms,
            entry.expires_at_ms,
            entry.etag,
            entry.last_modified,
            entry.repository,
            entry.key,
            entry.sha256,
        )

    async def delete_entry(self, repository: str, key: str, sha256: str | None) -> bool:
        return await self._execute("delete_entry", DELETE_ENTRY, repository, key, sha256) > 0

    async def touch_entries(self, accesses: Sequence[tuple[str, str, int]]) -> None:
        if not accesses:
            return
        repos, keys, ats = zip(*accesses, strict=True)
        await self._execute("touch_entries", TOUCH_ENTRIES, list(repos), list(keys), list(ats))

    async def usage(self, repository: str) -> Usage:
        row = await self._fetchrow("usage", USAGE, repository)
        return Usage(entries=int(row[0]), bytes=int(row[1]))

    async def least_recently_used(self, repository: str, limit: int) -> list[Entry]:
        rows = await self._fetch("least_recently_used", LEAST_RECENTLY_USED, repository, limit)
        return [entry_from_row(row) for row in rows]

    async def blob_is_referenced(self, sha256: str) -> bool:
        row = await self._fetchrow("blob_is_referenced", BLOB_REFERENCED, sha256)
        return bool(row[0])

    async def delete_expired_negatives(self, older_than_ms: int) -> int:
        return await self._execute(
            "delete_expired_negatives", DELETE_EXPIRED_NEGATIVES, older_than_ms
        )

    # -- links ---------------------------------------------------------------------

    async def put_links(self, links: Sequence[Link]) -> None:
        if not links:
            return
        await self._execute(
            "put_links",
            UPSERT_LINKS,
            [link.repository for link in links],
            [link.key for link in links],
            [link.url for link in links],
            [json.dumps(link.digests) for link in links],
            [link.size for link in links],
            now_ms(),
        )

    async def get_link(self, repository: str, key: str) -> Link | None:
        row = await self._fetchrow("get_link", SELECT_LINK, repository, key)
        if row is None:
            return None
        return Link(row[0], row[1], row[2], json.loads(row[3]), row[4])

    # -- fetch leases -------------------------------------------------------------------

    async def claim_lease(self, key: str, holder: str, ttl_s: float) -> LeaseGrant | None:
        row = await self._fetchrow("claim_lease", CLAIM_LEASE, key, holder, float(ttl_s))
        return LeaseGrant(key=key, holder=holder, fence=int(row[0])) if row else None

    async def renew_lease(self, grant: LeaseGrant, ttl_s: float) -> bool:
        touched = await self._execute(
            "renew_lease", RENEW_LEASE, grant.key, grant.holder, grant.fence, float(ttl_s)
        )
        return touched == 1

    async def release_lease(self, grant: LeaseGrant, state: str) -> bool:
        touched = await self._execute(
            "release_lease", RELEASE_LEASE, grant.key, grant.holder, grant.fence, state
        )
        return touched == 1

    async def get_lease(self, key: str) -> LeaseRow | None:
        row = await self._fetchrow("get_lease", SELECT_LEASE, key)
        if row is None:
            return None
        return LeaseRow(
            key=row[0], holder=row[1], fence=int(row[2]), state=row[3], expired=bool(row[4])
        )

    async def purge_leases(self, retention_s: float) -> int:
        return await self._execute("purge_leases", PURGE_LEASES, float(retention_s))

    # -- jobs ------------------------------------------------------------------------

    @asynccontextmanager
    async def job_lock(self, name: str) -> AsyncIterator[bool]:
        # A session lock on a connection held for the whole pass: if this process dies,
        # the server drops the connection and the lock with it.
        async with self._connection("job_lock") as conn:
            with _translated("job_lock"):
                acquired = bool(await conn.fetchval(TRY_JOB_LOCK, name))
            try:
                yield acquired
            finally:
                if acquired:
                    try:
                        await conn.execute(UNLOCK_JOB, name)
                    except _DRIVER_ERRORS as exc:
                        # The lock dies with the connection anyway; do not let this
                        # replace the pass's own outcome (or its cancellation).
                        log.warning("job %s: unlock failed: %s", name, exc)

    async def claim_job_run(self, name: str, interval_s: float, holder: str) -> int | None:
        row = await self._fetchrow("claim_job_run", CLAIM_JOB_RUN, name, float(interval_s), holder)
        return int(row[0]) if row else None

    async def give_back_job_run(self, name: str, run_id: int) -> None:
        await self._execute("give_back_job_run", GIVE_BACK_JOB_RUN, name, run_id)

    # -- notifications ------------------------------------------------------------------

    async def listen_leases(self, on_notify: Callable[[str], None]) -> None:
        """LISTEN on a dedicated connection; reconnect with backoff when it drops."""
        delay_s = 0.1
        while True:
            lost = asyncio.Event()
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(
                    self.dsn,
                    timeout=CONNECT_TIMEOUT_S,
                    server_settings={"application_name": LISTENER_APPLICATION_NAME},
                )
                conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
                await conn.add_listener(
                    NOTIFY_CHANNEL, lambda _conn, _pid, _channel, payload: on_notify(payload)
                )
                log.info("listening for lease notifications")
                delay_s = 0.1
                await lost.wait()
                log.warning("lease notification connection lost; polling until it is back")
            except _DRIVER_ERRORS as exc:
                log.warning("lease notifications unavailable (%s); retrying in %.1fs", exc, delay_s)
            finally:
                if conn is not None and not conn.is_closed():
                    conn.terminate()
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, LISTENER_RETRY_MAX_S)

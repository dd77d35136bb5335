"""The fleet catalog: Postgres through an asyncpg pool, plus one session connection.

Lease statements use ``clock_timestamp()`` (never ``now()``, which is the start of the
transaction), so the database clock is the only clock leases depend on. Migrations run
in one transaction under an advisory lock, so replicas started together on an empty
database all come up and the schema is applied once. Lease transitions are announced
with NOTIFY by a trigger.

Pooled connections only ever run single statements and managed transactions: no
LISTEN, no session lock, no SET, no named prepared statement (asyncpg's statement
cache is off). So the pool may be a transaction-mode PgBouncer, and a connection goes
back to the pool without a reset statement. What needs a session (LISTEN, the job
locks) is on the ``SessionConnection`` (docs/architecture.md, "The catalog's
connections").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg

from proxy.catalog import LeaseRow, StreamInfo, migration_files
from proxy.catalog.base import SqlCatalog
from proxy.catalog.queries import load
from proxy.catalog.session import DRIVER_ERRORS, SessionConnection, translated
from proxy.clock import Clock
from proxy.config.settings import DatabaseSettings
from proxy.exceptions import CatalogError, JobLockLost
from proxy.runtime import metrics

log = logging.getLogger("proxy.catalog")

POOL_MIN_SIZE = 1
COMMAND_TIMEOUT_S = 10.0
ACQUIRE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
NOTIFY_CHANNEL = "proxy_fetch_leases"
APPLICATION_NAME = "proxy"
SESSION_APPLICATION_NAME = "proxy-session"
# client_encoding spelled as the server reports it: asyncpg asks for "utf-8", and
# PgBouncer, which compares the names as strings, then sent a SET client_encoding
# before every transaction of ours, doubling what the pool costs Postgres.
POOL_SETTINGS = {"application_name": APPLICATION_NAME, "client_encoding": "UTF8"}

_CONNECTION_LOST = (
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.AdminShutdownError,
    asyncpg.CannotConnectNowError,
    ConnectionError,
)


class _PooledConnection(asyncpg.Connection):  # type: ignore[misc]
    """A pooled connection: nothing of its session outlives a statement or a managed
    transaction, so handing it back runs no reset (asyncpg's default reset is four
    statements: unlock all, CLOSE ALL, UNLISTEN *, RESET ALL)."""

    def get_reset_query(self) -> str:
        return ""


class PostgresCatalog(SqlCatalog):
    backend = "postgres"
    queries = load("postgres")

    def __init__(
        self,
        dsn: str,
        migrations: Path,
        clock: Clock,
        connections: DatabaseSettings | None = None,
    ) -> None:
        super().__init__(clock)
        self.dsn = dsn
        self.migrations = migrations
        self.connections = connections or DatabaseSettings()
        self.session = SessionConnection(
            self.connections.session_url or dsn,
            SESSION_APPLICATION_NAME,
            CONNECT_TIMEOUT_S,
            COMMAND_TIMEOUT_S,
        )
        self._pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()
        self._job_locks: set[str] = set()  # held by passes of this process
        self._closed = False

    async def _get_pool(self) -> asyncpg.Pool:
        if self._closed:
            raise CatalogError("postgres: the catalog is closed")
        if self._pool is None:
            async with self._pool_lock:
                if self._pool is None:
                    size = self.connections.pool_size
                    with translated("connect"):
                        self._pool = await asyncpg.create_pool(
                            self.dsn,
                            min_size=min(POOL_MIN_SIZE, size),
                            max_size=size,
                            max_inactive_connection_lifetime=self.connections.idle_timeout_s,
                            command_timeout=COMMAND_TIMEOUT_S,
                            timeout=CONNECT_TIMEOUT_S,
                            # Named prepared statements would be another client's
                            # behind a transaction pooler; unnamed ones live within
                            # one statement's round trips, which it keeps together.
                            statement_cache_size=0,
                            connection_class=_PooledConnection,
                            server_settings=POOL_SETTINGS,
                        )
        return self._pool

    @asynccontextmanager
    async def _connection(self, operation: str) -> AsyncIterator[asyncpg.Connection]:
        pool = await self._get_pool()
        with translated(operation):
            async with pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn:
                yield conn

    async def _call(self, method: str, name: str, *args: Any) -> Any:
        """Run one named statement; once more on a fresh connection if the pooled one
        was dead.

        After a database restart every pooled connection is broken; the retry spares
        the first request after the restart an error. Our statements are safe to
        repeat (a repeated claim is a re-entrant claim by the same holder).
        """
        sql = self.queries[name]
        for attempt in (1, 2):
            try:
                async with self._connection(name) as conn:
                    return await getattr(conn, method)(sql, *args)
            except CatalogError as exc:
                dead = isinstance(exc.__cause__, _CONNECTION_LOST)
                if attempt == 2 or not dead:
                    raise
                metrics.DATABASE_RECONNECTS.labels(connection="pool").inc()
                log.warning("a pooled database connection was lost (%s); retrying", exc)
        raise AssertionError("unreachable")

    async def _fetchrow(self, name: str, *args: Any) -> Any:
        return await self._call("fetchrow", name, *args)

    async def _fetch(self, name: str, *args: Any) -> list[Any]:
        return list(await self._call("fetch", name, *args))

    async def _execute(self, name: str, *args: Any) -> int:
        status: str = await self._call("execute", name, *args)
        tail = status.rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    async def _write_returning(self, name: str, *args: Any, prelude: tuple[str, ...] = ()) -> Any:
        assert not prelude, "Postgres statements need no prelude"
        return await self._call("fetchrow", name, *args)

    async def _write_fetch(self, name: str, *args: Any) -> list[Any]:
        return list(await self._call("fetch", name, *args))

    async def migrate(self) -> list[str]:
        files = migration_files(self.migrations)
        q = self.queries
        async with self._connection("migrate") as conn, conn.transaction():
            # Transaction-scoped: released by the commit, even if this process dies.
            await conn.execute(q["lock_migrations"])
            await conn.execute(q["create_schema_migrations"])
            done = {row["version"] for row in await conn.fetch(q["applied_migrations"])}
            applied = []
            for version, name, sql in files:
                if version in done:
                    continue
                await conn.execute(sql)
                await conn.execute(q["record_migration"], version, name)
                applied.append(name)
        return applied

    async def close(self) -> None:
        self._closed = True
        await self.session.close()
        if self._pool is not None:
            try:
                await asyncio.wait_for(self._pool.close(), timeout=5)
            except (TimeoutError, *DRIVER_ERRORS):
                self._pool.terminate()
            self._pool = None

    # -- jobs ------------------------------------------------------------------------

    @asynccontextmanager
    async def job_lock(self, name: str) -> AsyncIterator[bool]:
        """A session advisory lock on the session connection, for the whole pass.

        It dies with the connection: the server releases it when the process dies, and
        when the connection drops while the process lives on. Then the pass is
        cancelled at once and ``JobLockLost`` raised in its place, since another
        replica may take the lock and start the same job."""
        if name in self._job_locks:
            # A session lock is re-entrant: a second pass here would "get" it too.
            yield False
            return
        acquired = bool(await self.session.fetchval("job_lock", self.queries["try_job_lock"], name))
        if not acquired:
            yield False
            return
        self._job_locks.add(name)
        task = asyncio.current_task()
        assert task is not None
        lost = False

        def on_loss() -> None:
            nonlocal lost
            lost = True
            metrics.JOB_LOCKS_LOST.labels(job=name).inc()
            task.cancel()

        forget = self.session.on_loss(on_loss)
        try:
            yield True
        except asyncio.CancelledError:
            if not lost or task.uncancel() > 0:
                raise  # a cancellation of its own (shutdown)
            raise JobLockLost(
                f"job {name}: the database session holding its lock was lost"
            ) from None
        else:
            if lost:
                # Lost after the pass's last await: the cancellation asked for lands here.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0)
                task.uncancel()
                raise JobLockLost(f"job {name}: the database session holding its lock was lost")
        finally:
            forget()
            self._job_locks.discard(name)
            if not lost:
                try:
                    await self.session.fetchval("job_unlock", self.queries["unlock_job"], name)
                except CatalogError as exc:
                    # The lock dies with the connection anyway; do not let this
                    # replace the pass's own outcome (or its cancellation).
                    log.warning("job %s: unlock failed: %s", name, exc)

    # -- notifications ------------------------------------------------------------------

    async def listen_leases(
        self,
        on_notify: Callable[[str, LeaseRow | None], None],
        on_listening: Callable[[bool], None] | None = None,
    ) -> None:
        """LISTEN on the session connection, kept open (reconnected) until cancelled."""
        if on_listening is not None:
            self.session.watch(on_listening)
        await self.session.listen(
            NOTIFY_CHANNEL, lambda payload: on_notify(*lease_notification(payload))
        )
        await self.session.keep_open()


def lease_notification(payload: str) -> tuple[str, LeaseRow | None]:
    """``(key, row)`` from a notification of the ``fetch_leases_notify`` trigger (a JSON
    object, migrations 0004 and 0005); an older trigger sent the key alone: ``(key, None)``."""
    try:
        fields = json.loads(payload)
        stream = None
        relay = fields.get("relay")  # migration 0005: the relay of object storage
        if (fields["file"] is not None or relay is not None) and fields["length"] is not None:
            stream = StreamInfo(
                None if fields["file"] is None else str(fields["file"]),
                fields["type"],
                int(fields["length"]),
                None if relay is None else str(relay),
                fields.get("token"),
            )
        row = LeaseRow(
            key=str(fields["key"]),
            holder=str(fields["holder"]),
            fence=int(fields["fence"]),
            state=str(fields["state"]),
            expired=False,
            stream=stream,
        )
    except (ValueError, TypeError, KeyError):
        return payload, None
    return row.key, row

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
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import asyncpg

from proxy.catalog import migration_files
from proxy.catalog.base import SqlCatalog
from proxy.catalog.queries import load
from proxy.clock import Clock
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

# InternalClientError: a pooled connection left in a broken state by a server restart
# ("cannot switch to state 12; another operation is in progress").
_DRIVER_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)
_CONNECTION_LOST = (
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
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


class PostgresCatalog(SqlCatalog):
    backend = "postgres"
    queries = load("postgres")

    def __init__(self, dsn: str, migrations: Path, clock: Clock) -> None:
        super().__init__(clock)
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
            done = {row[0] for row in await conn.fetch(q["applied_migrations"])}
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
        if self._pool is not None:
            try:
                await asyncio.wait_for(self._pool.close(), timeout=5)
            except (TimeoutError, *_DRIVER_ERRORS):
                self._pool.terminate()
            self._pool = None

    # -- jobs ------------------------------------------------------------------------

    @asynccontextmanager
    async def job_lock(self, name: str) -> AsyncIterator[bool]:
        # A session lock on a connection held for the whole pass: if this process dies,
        # the server drops the connection and the lock with it.
        async with self._connection("job_lock") as conn:
            with _translated("job_lock"):
                acquired = bool(await conn.fetchval(self.queries["try_job_lock"], name))
            try:
                yield acquired
            finally:
                if acquired:
                    try:
                        await conn.execute(self.queries["unlock_job"], name)
                    except _DRIVER_ERRORS as exc:
                        # The lock dies with the connection anyway; do not let this
                        # replace the pass's own outcome (or its cancellation).
                        log.warning("job %s: unlock failed: %s", name, exc)

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

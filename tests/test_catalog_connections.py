"""The Postgres catalog's connections (proxy/catalog/postgres.py, proxy/catalog/session.py;
docs/architecture.md, "The catalog's connections"), on a real server: a bounded pool
whose connections go back without a reset and close when idle, and one session
connection for LISTEN and job locks that reconnects by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from proxy.catalog import Entry, open_catalog
from proxy.catalog.postgres import POOL_MIN_SIZE, PostgresCatalog
from proxy.config.settings import DatabaseSettings
from proxy.exceptions import JobLockLost
from proxy.runtime import metrics
from proxy.types import Kind
from tests.pg import PostgresServer, create_database

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


@pytest.fixture(scope="module")
def counted_server() -> Iterator[PostgresServer]:
    """A server of this module's own that counts statements (pg_stat_statements)."""
    server = PostgresServer({"shared_preload_libraries": "pg_stat_statements"}).init().start()
    yield server
    server.destroy()


@pytest.fixture
async def admin(pg_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg_url)
    yield conn
    await conn.close()


def postgres(url: str, **connections: object) -> PostgresCatalog:
    catalog = open_catalog(url, connections=DatabaseSettings(**connections))  # type: ignore[arg-type]
    assert isinstance(catalog, PostgresCatalog)
    return catalog


async def connections_of(admin: asyncpg.Connection, application: str) -> int:
    return int(
        await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = $1 AND datname = current_database()",
            application,
        )
    )


async def test_a_pooled_connection_goes_back_without_a_reset(
    counted_server: PostgresServer,
) -> None:
    url = await asyncio.to_thread(create_database, counted_server.admin_url)
    stats = await asyncpg.connect(counted_server.admin_url)
    await stats.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    catalog = postgres(url)
    try:
        await catalog.migrate()
        await stats.fetchval("SELECT pg_stat_statements_reset()")
        for i in range(20):
            await catalog.get_entry("r", f"k{i}")
        rows = await stats.fetch(
            "SELECT s.query, s.calls FROM pg_stat_statements AS s "
            "JOIN pg_database AS d ON d.oid = s.dbid WHERE d.datname = $1",
            url.rpartition("/")[2],
        )
        calls = {row["query"]: int(row["calls"]) for row in rows}
        # Twenty reads cost twenty statements: no unlock/CLOSE ALL/UNLISTEN/RESET ALL.
        assert sum(calls.values()) == 20, calls
        assert all(query.startswith("SELECT repository, key") for query in calls), calls
        # And no named prepared statement is left on the pooled connection.
        async with catalog._connection("test") as conn:
            assert await conn.fetchval("SELECT count(*) FROM pg_prepared_statements") == 0
    finally:
        await catalog.close()
        await stats.close()


async def test_the_pool_is_bounded_and_gives_idle_connections_back(
    pg_url: str, admin: asyncpg.Connection
) -> None:
    catalog = postgres(pg_url, pool_size=3, idle_timeout_s=1.0)
    await catalog.migrate()
    try:
        # A burst of writes that all wait for a row the test holds locked: each holds a
        # pooled connection while it waits.
        entry = Entry("r", "busy", Kind.IMMUTABLE, "0" * 64, 1, None, 0, None)
        await catalog.put_entry(entry)
        blocker = await asyncpg.connect(pg_url)
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("SELECT * FROM entries WHERE key = 'busy' FOR UPDATE")
        writes = [asyncio.ensure_future(catalog.put_entry(entry)) for _ in range(12)]
        peak = 0
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            peak = max(peak, await connections_of(admin, "proxy"))
            await asyncio.sleep(0.05)
        assert peak == 3  # the burst used the whole pool, and no more
        await tx.commit()
        await blocker.close()
        await asyncio.gather(*writes)  # each had its turn within the acquire timeout
        # Unused for the idle timeout, the pool's connections are closed, down to the
        # one it keeps (POOL_MIN_SIZE).
        deadline = time.monotonic() + 10
        while await connections_of(admin, "proxy") > POOL_MIN_SIZE:
            assert time.monotonic() < deadline, "idle pooled connections were kept"
            await asyncio.sleep(0.1)
        assert await catalog.get_entry("r", "k") is None  # and made again when needed
    finally:
        await catalog.close()


async def test_job_locks_are_held_on_the_session_connection(
    pg_url: str, admin: asyncpg.Connection
) -> None:
    a, b = postgres(pg_url), postgres(pg_url)
    await a.migrate()
    try:
        async with a.job_lock("evict") as got:
            assert got
            holder = await admin.fetchval(
                "SELECT a.application_name FROM pg_locks AS l "
                "JOIN pg_stat_activity AS a ON a.pid = l.pid WHERE l.locktype = 'advisory'"
            )
            assert holder == "proxy-session"
            async with b.job_lock("evict") as other:
                assert not other  # another replica
            async with a.job_lock("evict") as again:
                assert not again  # another pass of the same replica
        async with b.job_lock("evict") as got_b:
            assert got_b
    finally:
        await a.close()
        await b.close()


async def terminate_sessions(admin: asyncpg.Connection) -> int:
    return int(
        await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'proxy-session' AND datname = current_database()"
        )
    )


async def test_a_pass_whose_lock_connection_dies_is_stopped(
    pg_url: str, admin: asyncpg.Connection
) -> None:
    a, b = postgres(pg_url), postgres(pg_url)
    await a.migrate()
    passing = asyncio.Event()
    cancelled = asyncio.Event()

    async def long_pass() -> None:
        async with a.job_lock("reclaim") as got:
            assert got
            passing.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    before = metrics.JOB_LOCKS_LOST.labels(job="reclaim")._value.get()
    try:
        task = asyncio.ensure_future(long_pass())
        await asyncio.wait_for(passing.wait(), 10)
        assert await terminate_sessions(admin) == 1
        with pytest.raises(JobLockLost, match="reclaim"):
            await asyncio.wait_for(task, 10)
        assert cancelled.is_set()  # the pass itself was stopped, not left running
        assert metrics.JOB_LOCKS_LOST.labels(job="reclaim")._value.get() == before + 1
        async with b.job_lock("reclaim") as got_b:
            assert got_b  # the server let the lock go with the connection
        async with a.job_lock("reclaim") as again:
            assert again  # and the session connection is made again
    finally:
        await a.close()
        await b.close()


async def test_the_session_listens_again_after_a_drop(
    pg_url: str, admin: asyncpg.Connection
) -> None:
    catalog = postgres(pg_url)
    await catalog.migrate()
    received: list[str] = []
    states: list[bool] = []
    reconnects = metrics.DATABASE_RECONNECTS.labels(connection="session")
    before = reconnects._value.get()
    listening = asyncio.ensure_future(
        catalog.listen_leases(lambda key, _row: received.append(key), states.append)
    )

    async def until(condition: object, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():  # type: ignore[operator]
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    try:
        await until(lambda: states == [True], "never listened")
        await catalog.claim_lease("r/one", "h", 30)
        await until(lambda: len(received) == 1, "no notification")
        assert await terminate_sessions(admin) == 1
        await until(lambda: states == [True, False, True], "did not listen again")
        assert reconnects._value.get() == before + 1
        await catalog.claim_lease("r/two", "h", 30)
        await until(lambda: len(received) == 2, "no notification after the reconnect")
    finally:
        listening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listening
        await catalog.close()

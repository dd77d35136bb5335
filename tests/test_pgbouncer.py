"""A fleet behind a real PgBouncer in transaction pooling mode (docs/architecture.md,
"The catalog's connections"; README, "Running a large fleet"): the pool through
PgBouncer, each replica's session connection straight to Postgres.

The fleet and streaming suites (tests/test_fleet.py, tests/test_streaming.py) run behind
it too (the ``fleet_db`` fixture); these tests check what only a pooler can break:
named prepared statements, notifications, job locks.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from proxy.catalog import migrations_dir
from proxy.catalog.postgres import PostgresCatalog
from proxy.clock import SYSTEM_CLOCK
from tests.pg import PostgresServer
from tests.pgbouncer import FleetDb, PgBouncer, behind
from tests.processes import ProxyProcess
from tests.test_fleet import Fleet, fetch_digests, fleet_config, lease_row, wait_for_holder
from tests.upstream import FakeUpstream, ProjectFile

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MiB = 1024 * 1024
POOLER_ERRORS = ("prepared statement", "PreparedStatement", "InvalidSQLStatementName")
MIRROR = """
[[mirrors]]
name = "nightly"
interval = "1h"
packages = ["pkg:pypi/demo@1.0", "pkg:pypi/other@2.0"]
"""
JOB = "mirror:nightly"


@pytest.fixture
def bounced(pg_url: str) -> Iterator[tuple[FleetDb, PgBouncer]]:
    db, bouncer = behind("pgbouncer", pg_url)
    assert bouncer is not None
    yield db, bouncer
    bouncer.stop()


@pytest.fixture
def fleets() -> Iterator[list[Fleet]]:
    started: list[Fleet] = []
    yield started
    for fleet in started:
        fleet.stop()


def start_fleet(
    fleets: list[Fleet],
    tmp_path: Path,
    db: FleetDb,
    upstream: FakeUpstream,
    count: int,
    ttl: str = "3s",
    extra: str = "",
) -> list[ProxyProcess]:
    fleet = Fleet(tmp_path, fleet_config(tmp_path, db, upstream.base_url, ttl=ttl, extra=extra))
    fleets.append(fleet)
    return fleet.start(count)


def query(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(url)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(run())


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def no_pooler_errors(replicas: list[ProxyProcess]) -> None:
    for replica in replicas:
        log = replica.log()
        assert not [e for e in POOLER_ERRORS if e in log], log[-3000:]


def test_a_waiting_replica_is_woken_by_a_notification_not_by_its_poll(
    tmp_path: Path,
    pg_url: str,
    bounced: tuple[FleetDb, PgBouncer],
    upstream: FakeUpstream,
    fleets: list[Fleet],
) -> None:
    """A miss two replicas ask for, through PgBouncer: one upstream GET, no pooler
    error, and the waiter ends with the holder's outcome, which only a notification
    can tell it in time: with a TTL of 20 minutes it would look at the lease again
    only after 320 s or more (the renewal pace, jittered), longer than the client's
    120 s read timeout. How soon the notification wakes it is a bench figure
    (bench/pg_cost.py, "a waiting replica's last byte after the holder's release")."""
    db, _bouncer = bounced
    body = os.urandom(4 * MiB)
    upstream.add_project("big", [ProjectFile("big-1.0.tar.gz", body)])
    upstream.fault("/packages/big-1.0.tar.gz", chunk_size=MiB, chunk_delay_s=0.5)
    holder, waiter = start_fleet(fleets, tmp_path, db, upstream, 2, ttl="20m")
    assert httpx.get(holder.url + "/pypi/simple/big/").status_code == 200
    path = "/pypi/files/big/big-1.0.tar.gz"
    key = "pypi/files/big/big-1.0.tar.gz"

    async def scenario() -> list[tuple[int, str, int]]:
        holding = asyncio.ensure_future(fetch_digests([holder.url + path]))
        await asyncio.to_thread(wait_for_holder, pg_url, key)
        waiting = await fetch_digests([waiter.url + path])
        return [*(await holding), *waiting]

    results = asyncio.run(scenario())
    expected = hashlib.sha256(body).hexdigest()
    assert results == [(200, expected, len(body))] * 2
    row = asyncio.run(lease_row(pg_url, key))
    assert row is not None and row["state"] == "done"
    assert waiter.metric("proxy_fetch_lease_notifications_total") >= 2  # the file, the outcome
    assert upstream.count("/packages/big-1.0.tar.gz") == 1
    no_pooler_errors([holder, waiter])


def add_mirrored(upstream: FakeUpstream) -> list[str]:
    """Two packages whose files take ~2 s each to download."""
    upstream.add_project("demo", [ProjectFile("demo-1.0.tar.gz", os.urandom(4 * MiB))])
    upstream.add_project("other", [ProjectFile("other-2.0.tar.gz", os.urandom(4 * MiB))])
    paths = ["/packages/demo-1.0.tar.gz", "/packages/other-2.0.tar.gz"]
    for p in paths:
        upstream.fault(p, chunk_size=MiB, chunk_delay_s=0.5)
    return paths


LOCK_HOLDERS = """
SELECT l.pid, a.application_name FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtext('proxy-job:' || $1)::bigint
"""
LAST_RUN = "SELECT run_id, holder, outcome FROM job_runs WHERE name = $1"


def test_job_locks_are_held_once_per_fleet_and_given_back_when_their_connection_dies(
    tmp_path: Path,
    pg_url: str,
    bounced: tuple[FleetDb, PgBouncer],
    upstream: FakeUpstream,
    fleets: list[Fleet],
) -> None:
    db, bouncer = bounced
    add_mirrored(upstream)
    replicas = start_fleet(fleets, tmp_path, db, upstream, 3, extra=MIRROR)
    holders: list[int] = []

    def lock_holders() -> list[asyncpg.Record]:
        rows = query(pg_url, LOCK_HOLDERS, JOB)
        holders.append(len(rows))
        return rows

    wait_for("a pass to hold the mirror's lock", lambda: len(lock_holders()) == 1)
    [(pid, application)] = lock_holders()
    # The lock lives on a session connection straight to Postgres, not on one of the
    # server connections PgBouncer hands round.
    assert application == "proxy-session"
    [(run_id, holder, outcome)] = query(pg_url, LAST_RUN, JOB)
    assert outcome == "running"
    [running] = [r for r in replicas if f":{r.pid}:" in holder]
    query(pg_url, "SELECT pg_terminate_backend($1)", pid)
    # The pass whose lock went is stopped and its claim given back; the run is taken
    # up again at once (by any replica), never by two at a time.
    wait_for("the run to be taken up again", lambda: query(pg_url, LAST_RUN, JOB)[0][0] > run_id)
    wait_for("the lock is lost and logged", lambda: "lock was lost" in running.log())
    assert running.metric("proxy_job_locks_lost_total", job=JOB) == 1

    def finished() -> bool:
        lock_holders()
        return bool(query(pg_url, LAST_RUN, JOB)[0][2] == "ok")

    wait_for("the run to finish", finished, timeout_s=60)
    assert max(holders) == 1, holders
    assert (
        sum(r.metric("proxy_database_reconnects_total", connection="session") for r in replicas)
        >= 1
    )
    # PgBouncer gave the whole fleet (3 replicas x 10 pooled connections) its pool of 4.
    servers = query(
        pg_url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name <> 'proxy-session' AND pid <> pg_backend_pid()",
    )[0][0]
    assert servers <= bouncer.pool_size
    no_pooler_errors(replicas)


def test_the_pool_behind_pgbouncer_costs_postgres_no_statement_of_its_own() -> None:
    """PgBouncer sets a client's parameters on the server connection it lends when they
    differ from it: asyncpg's client_encoding "utf-8" against the server's "UTF8" was a
    SET before every transaction (as many statements again as the proxy's own)."""
    server = PostgresServer({"shared_preload_libraries": "pg_stat_statements"}).init().start()
    db, bouncer = behind("pgbouncer", server.admin_url)
    assert bouncer is not None

    async def scenario() -> list[asyncpg.Record]:
        admin = await asyncpg.connect(server.admin_url)
        catalog = PostgresCatalog(db.url, migrations_dir() / "postgres", SYSTEM_CLOCK)
        try:
            await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            await catalog.migrate()
            await admin.execute("SELECT pg_stat_statements_reset()")
            for n in range(20):
                assert await catalog.get_lease(f"r/k{n}") is None
            return list(
                await admin.fetch(
                    "SELECT query, calls FROM pg_stat_statements "
                    "WHERE query NOT LIKE '%pg_stat_statements%'"
                )
            )
        finally:
            await catalog.close()
            await admin.close()

    try:
        counted = asyncio.run(scenario())
    finally:
        bouncer.stop()
        server.destroy()
    assert sum(r["calls"] for r in counted) == 20, counted
    assert not [r for r in counted if r["query"].upper().startswith("SET")], counted

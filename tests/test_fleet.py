"""Several real `proxy serve` processes on one Postgres database, with their blobs in one
shared storage folder or in one bucket (each replica with only a local folder of its
own), and with their pool straight on Postgres or behind a real PgBouncer in
transaction mode (their session connections straight on Postgres): every test runs on
a folder and on a bucket, and those marked ``pgbouncer`` once more behind PgBouncer
(``fleet_variant``, parametrized in tests/conftest.py).

Each test below fails on the wrong implementation of one rule of docs/architecture.md ("The request path of a miss", "Fetch leases").
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.conftest import s3_storage
from tests.pg import PostgresServer
from tests.pgbouncer import FleetDb, PgBouncer, behind
from tests.processes import ProxyProcess, start_replicas
from tests.seaweed import SeaweedFS
from tests.upstream import FakeUpstream, ProjectFile

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MiB = 1024 * 1024


@dataclass(frozen=True)
class FleetStorage:
    """Where a fleet's blobs live: ``folder`` (one shared volume) or ``s3`` (a bucket;
    each replica has a local folder of its own, ``local-<replica name>``)."""

    kind: str
    keys: str  # the [storage] table (and [storage.s3])
    env: dict[str, str] = field(default_factory=dict)
    bucket: str | None = None
    seaweedfs: SeaweedFS | None = None

    def objects(self) -> dict[str, int]:
        assert self.seaweedfs is not None and self.bucket is not None
        return self.seaweedfs.keys(self.bucket)


def folder_storage(tmp_path: Path) -> FleetStorage:
    return FleetStorage("folder", f'path = "{tmp_path / "shared"}"')


@pytest.fixture
def fleet_storage(
    request: pytest.FixtureRequest, tmp_path: Path, fleet_variant: str
) -> FleetStorage:
    if fleet_variant != "s3":
        return folder_storage(tmp_path)
    seaweedfs: SeaweedFS = request.getfixturevalue("seaweedfs")
    bucket: str = request.getfixturevalue("s3_bucket")
    local = Path(f"{tmp_path}/local-${{REPLICA_NAME}}")
    keys = f'path = "{tmp_path / "data"}"\n' + s3_storage(seaweedfs, bucket, local)
    return FleetStorage("s3", keys, seaweedfs.env, bucket, seaweedfs)


@pytest.fixture
def fleet_db(pg_url: str, fleet_variant: str) -> Iterator[FleetDb]:
    """The test's database as its fleet reaches it (``FleetDb.route``)."""
    route = "pgbouncer" if fleet_variant == "pgbouncer" else "direct"
    db, bouncer = behind(route, pg_url)
    yield db
    if bouncer is not None:
        bouncer.stop()


def fleet_config(
    tmp_path: Path,
    db: FleetDb | str,
    upstream_url: str,
    ttl: str = "3s",
    read_timeout: str = "5s",
    metadata_ttl: str = "10m",
    extra_leases: str = "",
    extra: str = "",
    jobs: str = "",
    name: str = "fleet.toml",
    storage: FleetStorage | None = None,
) -> Path:
    storage = storage or folder_storage(tmp_path)
    db = db if isinstance(db, FleetDb) else FleetDb(db, db)
    session = f'session_url = "{db.session_url}"' if db.session_url else ""
    path = tmp_path / name
    path.write_text(f"""
[database]
url = "{db.url}"
{session}
[storage]
{storage.keys}
[upstream]
connect_timeout = "2s"
read_timeout = "{read_timeout}"
retries = 0
[leases]
ttl = "{ttl}"
poll_interval = "250ms"
{extra_leases}
{jobs}
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{upstream_url}/simple/"
metadata_ttl = "{metadata_ttl}"
negative_ttl = "1m"
{extra}
""")
    return path


class Fleet:
    def __init__(self, tmp_path: Path, config: Path, env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.config = config
        self.env = env or {}
        self.replicas: list[ProxyProcess] = []

    def start(self, count: int, env: dict[str, str] | None = None) -> list[ProxyProcess]:
        env = {**self.env, **(env or {})}
        return start_replicas(self.replicas, self.config, self.tmp_path, count, env=env)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


class Fleets(list[Fleet]):
    """The fleets of one test, on one storage and one route to the database."""

    def __init__(self, storage: FleetStorage, db: FleetDb) -> None:
        super().__init__()
        self.storage = storage
        self.db = db
        self.stopped_after: list[PgBouncer] = []  # what the replicas use, stopped last


@pytest.fixture
def fleet(tmp_path: Path, fleet_storage: FleetStorage, fleet_db: FleetDb) -> Iterator[Fleets]:
    fleets = Fleets(fleet_storage, fleet_db)
    yield fleets
    for f in fleets:
        f.stop()
    for thing in fleets.stopped_after:
        thing.stop()


def make_fleet(fleets: Fleets, tmp_path: Path, config: Path) -> Fleet:
    f = Fleet(tmp_path, config, fleets.storage.env)
    fleets.append(f)
    return f


def add_big_file(upstream: FakeUpstream, size: int, **fault: object) -> ProjectFile:
    f = ProjectFile("big-1.0.tar.gz", os.urandom(size))
    upstream.add_project("big", [f])
    if fault:
        upstream.fault(f"/packages/{f.filename}", **fault)
    return f


async def lease_row(db_url: str, key: str) -> asyncpg.Record | None:
    conn = await asyncpg.connect(db_url)
    try:
        return await conn.fetchrow("SELECT * FROM fetch_leases WHERE key = $1", key)
    finally:
        await conn.close()


def wait_for_holder(db_url: str, key: str, timeout_s: float = 20) -> asyncpg.Record:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = asyncio.run(lease_row(db_url, key))
        if row is not None and row["state"] == "fetching":
            return row
        time.sleep(0.02)
    raise AssertionError(f"nobody claimed {key}")


def holder_pid(row: asyncpg.Record) -> int:
    return int(row["holder"].split(":")[1])


async def fetch_digests(urls: list[str]) -> list[tuple[int, str, int]]:
    """GET every URL at once; (status, sha256 of the body, length) for each."""
    limits = httpx.Limits(max_connections=len(urls) + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(url: str) -> tuple[int, str, int]:
            digest = hashlib.sha256()
            size = 0
            async with client.stream("GET", url) as response:
                async for chunk in response.aiter_bytes():
                    digest.update(chunk)
                    size += len(chunk)
                return response.status_code, digest.hexdigest(), size

        return await asyncio.gather(*(one(u) for u in urls))


FILE_KEY = "pypi/files/big/big-1.0.tar.gz"


@pytest.mark.pgbouncer
def test_replicas_started_together_on_an_empty_database_all_come_up(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    f = make_fleet(
        fleet, tmp_path, fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage)
    )
    replicas = f.start(4)
    assert all(r.process is not None and r.process.poll() is None for r in replicas)

    async def migrations() -> list[str]:
        conn = await asyncpg.connect(pg_url)
        try:
            return [r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")]
        finally:
            await conn.close()

    names = asyncio.run(migrations())
    migration_files = sorted(p.stem for p in Path("migrations/postgres").glob("*.sql"))
    assert sorted(names) == migration_files  # each applied exactly once


def test_one_upstream_get_for_the_whole_fleet(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    big = add_big_file(upstream, 50 * MiB, chunk_size=MiB, chunk_delay_s=0.05)
    f = make_fleet(
        fleet, tmp_path, fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage)
    )
    replicas = f.start(3)
    assert httpx.get(replicas[0].url + "/pypi/simple/big/").status_code == 200
    urls = [r.url + f"/pypi/files/big/{big.filename}" for r in replicas for _ in range(30)]
    results = asyncio.run(fetch_digests(urls))
    expected = hashlib.sha256(big.body).hexdigest()
    assert results == [(200, expected, len(big.body))] * 90
    assert upstream.count(f"/packages/{big.filename}") == 1
    waits = [r.metric("proxy_fetch_lease_waits_total", repository="pypi") for r in replicas]
    assert sum(waits) >= 2, waits  # the replicas that did not fetch waited on the lease
    assert sorted(waits)[0] == 0  # and the holder did not

    def claims(result: str) -> float:
        return sum(
            r.metric("proxy_fetch_lease_claims_total", repository="pypi", result=result)
            for r in replicas
        )

    # One claim per replica for the file and one for the page: a replica that follows
    # the holder's stream claims no more, and one that comes after the holder stored
    # it finds the entry instead of winning a fresh lease.
    assert (claims("won"), claims("held_elsewhere")) == (2, 2)


@pytest.mark.pgbouncer
def test_wait_is_detached_from_the_clients_that_started_it(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    big = add_big_file(upstream, 8 * MiB, chunk_size=MiB, chunk_delay_s=0.3)
    f = make_fleet(
        fleet, tmp_path, fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage)
    )
    holder, waiter = f.start(2)
    httpx.get(holder.url + "/pypi/simple/big/")
    path = f"/pypi/files/big/{big.filename}"

    async def scenario() -> tuple[int, str, int]:
        holding = asyncio.ensure_future(fetch_digests([holder.url + path]))
        await asyncio.to_thread(wait_for_holder, pg_url, FILE_KEY)
        # Every client of the waiting replica leaves before the holder is done (after its
        # first bytes: waiting replicas stream the holder's file as it grows).
        async with httpx.AsyncClient() as client, client.stream("GET", waiter.url + path) as r:
            assert r.status_code == 200 and r.headers["content-length"] == str(len(big.body))
            first = await anext(r.aiter_bytes())
            assert first and big.body.startswith(first)
        [result] = await holding
        return result

    assert asyncio.run(scenario())[0] == 200
    deadline = time.monotonic() + 10
    while waiter.metric("proxy_fetch_lease_wait_duration_seconds_count", outcome="entry") < 1:
        assert time.monotonic() < deadline, "the detached wait did not finish"
        time.sleep(0.1)
    response = httpx.get(waiter.url + path, timeout=30)
    assert response.content == big.body
    assert upstream.count(f"/packages/{big.filename}") == 1


def test_sigkill_of_the_holder_is_taken_over_after_expiry(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    big = add_big_file(upstream, 12 * MiB, chunk_size=MiB, chunk_delay_s=0.25)
    f = make_fleet(
        fleet,
        tmp_path,
        fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage, ttl="2s"),
    )
    replicas = f.start(3)
    httpx.get(replicas[0].url + "/pypi/simple/big/")
    path = f"/pypi/files/big/{big.filename}"

    async def scenario() -> list[tuple[int, str, int]]:
        first = asyncio.ensure_future(fetch_digests([replicas[0].url + path]))
        row = await asyncio.to_thread(wait_for_holder, pg_url, FILE_KEY)
        assert holder_pid(row) == replicas[0].pid
        others = asyncio.ensure_future(  # noqa: RUF006
            fetch_digests([r.url + path for r in replicas[1:] for _ in range(3)])
        )
        await asyncio.sleep(1.0)  # mid-download
        replicas[0].signal(signal.SIGKILL)
        results = await others
        with pytest.raises(httpx.HTTPError):
            await first  # its replica died under it
        return results

    results = asyncio.run(scenario())
    expected = hashlib.sha256(big.body).hexdigest()
    assert results == [(200, expected, len(big.body))] * 6
    assert upstream.count(f"/packages/{big.filename}") == 2
    row = asyncio.run(lease_row(pg_url, FILE_KEY))
    assert row is not None and row["state"] == "done"
    assert holder_pid(row) in (replicas[1].pid, replicas[2].pid)
    survivors = replicas[1:]
    assert (
        sum(r.metric("proxy_fetch_lease_takeovers_total", repository="pypi") for r in survivors)
        == 1
    )
    # The killed process left only a temp file behind, never a wrong blob.
    if fleet.storage.kind == "folder":
        shared = tmp_path / "shared"
        assert any(p.suffix == ".part" for p in (shared / "tmp").iterdir())
        blobs = {p.name for p in (shared / "blobs").rglob("*") if p.is_file()}
        assert expected in blobs
    else:
        killed = tmp_path / f"local-{replicas[0].name}"
        assert any(p.suffix == ".part" for p in (killed / "tmp").iterdir())
        seaweedfs, bucket = fleet.storage.seaweedfs, fleet.storage.bucket
        assert seaweedfs is not None and bucket is not None
        objects = fleet.storage.objects()
        assert expected in {key.rpartition("/")[2] for key in objects}
        for key in objects:  # every object at a final key holds the bytes its name says
            assert hashlib.sha256(seaweedfs.get(bucket, key)).hexdigest() == key[-64:]
        assert seaweedfs.uploads(bucket) == []


@pytest.mark.pgbouncer
def test_sigterm_of_the_holder_hands_over_at_once(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    big = add_big_file(upstream, 12 * MiB, chunk_size=MiB, chunk_delay_s=0.25)
    # A TTL of 30s: a takeover by expiry could not happen within this test's bound.
    f = make_fleet(
        fleet,
        tmp_path,
        fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage, ttl="30s"),
    )
    holder, waiter = f.start(2)
    httpx.get(holder.url + "/pypi/simple/big/")
    path = f"/pypi/files/big/{big.filename}"

    async def scenario() -> tuple[list[tuple[int, str, int]], float]:
        holders_client = asyncio.ensure_future(fetch_digests([holder.url + path]))
        row = await asyncio.to_thread(wait_for_holder, pg_url, FILE_KEY)
        assert holder_pid(row) == holder.pid
        waiting = asyncio.ensure_future(fetch_digests([waiter.url + path]))
        await asyncio.sleep(0.5)
        sent = time.monotonic()
        holder.signal(signal.SIGTERM)
        while True:
            current = await lease_row(pg_url, FILE_KEY)
            if current is not None and holder_pid(current) == waiter.pid:
                break
            await asyncio.sleep(0.01)
        handover_s = time.monotonic() - sent
        with pytest.raises(httpx.RemoteProtocolError):
            await holders_client  # its download was cut short by the shutdown
        return await waiting, handover_s

    results, handover_s = asyncio.run(scenario())
    assert holder.wait(30) == 0  # a clean stop (proxy/http/server.py owns the signal)
    assert "shut down: flushed" in holder.log()
    assert results == [(200, hashlib.sha256(big.body).hexdigest(), len(big.body))]
    assert handover_s < 5, f"handover took {handover_s:.2f}s: the lease was not released on SIGTERM"
    assert upstream.count(f"/packages/{big.filename}") == 2


def _stale_page_scenario(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets, with_stale: bool
) -> tuple[list[httpx.Response], float, int]:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    timeout_s = 3.0
    config = fleet_config(
        tmp_path,
        fleet.db,
        upstream.base_url,
        storage=fleet.storage,
        read_timeout=f"{timeout_s}s",
        metadata_ttl="1s",
    )
    replicas = make_fleet(fleet, tmp_path, config).start(4)
    if with_stale:
        assert httpx.get(replicas[0].url + "/pypi/simple/alpha/").status_code == 200
        time.sleep(1.2)  # expired everywhere
    upstream.fault("/simple/alpha/", hang=True)

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                *(client.get(r.url + "/pypi/simple/alpha/") for r in replicas)
            )

    started = time.monotonic()
    responses = asyncio.run(all_at_once())
    elapsed = time.monotonic() - started
    upstream.clear_faults()
    return responses, elapsed / timeout_s, upstream.count("/simple/alpha/")


@pytest.mark.pgbouncer
def test_failed_fetch_lets_waiters_serve_stale_at_once(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    responses, timeouts, gets = _stale_page_scenario(tmp_path, pg_url, upstream, fleet, True)
    assert [r.status_code for r in responses] == [200] * 4
    assert all("110" in r.headers["warning"] for r in responses)
    assert gets == 2  # the first fill, then only the holder tried
    assert timeouts < 1.8, f"clients waited {timeouts:.1f} upstream timeouts, not one"


def test_failed_fetch_without_stale_copy_lets_waiters_fetch_concurrently(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    responses, timeouts, gets = _stale_page_scenario(tmp_path, pg_url, upstream, fleet, False)
    assert [r.status_code for r in responses] == [504] * 4
    assert gets == 4  # the holder, then the three waiters side by side
    assert timeouts < 2.8, f"clients waited {timeouts:.1f} upstream timeouts: waiters took turns"


@pytest.mark.pgbouncer
def test_notifications_wake_waiters_and_polling_covers_lost_ones(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    big = add_big_file(upstream, 4 * MiB, chunk_size=MiB, chunk_delay_s=0.3)
    f = make_fleet(
        fleet, tmp_path, fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage)
    )
    holder, listening = f.start(2)
    # A third replica that never LISTENs: its waits end by polling alone.
    deaf_config = fleet_config(
        tmp_path,
        fleet.db,
        upstream.base_url,
        storage=fleet.storage,
        extra_leases="notify = false",
        name="deaf.toml",
    )
    deaf = make_fleet(fleet, tmp_path, deaf_config).start(1)[0]
    httpx.get(holder.url + "/pypi/simple/big/")
    path = f"/pypi/files/big/{big.filename}"

    async def scenario() -> list[tuple[int, str, int]]:
        first = asyncio.ensure_future(fetch_digests([holder.url + path]))
        await asyncio.to_thread(wait_for_holder, pg_url, FILE_KEY)
        rest = await fetch_digests([listening.url + path, deaf.url + path])
        return [*(await first), *rest]

    results = asyncio.run(scenario())
    assert results == [(200, hashlib.sha256(big.body).hexdigest(), len(big.body))] * 3
    assert upstream.count(f"/packages/{big.filename}") == 1
    assert listening.metric("proxy_fetch_lease_notifications_total") >= 1
    assert deaf.metric("proxy_fetch_lease_notifications_total") == 0
    assert deaf.metric("proxy_fetch_lease_wait_duration_seconds_count", outcome="entry") == 1


@pytest.mark.pgbouncer
def test_dropped_listener_connection_is_replaced(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    big = add_big_file(upstream, 2 * MiB, chunk_size=MiB, chunk_delay_s=0.5)
    f = make_fleet(
        fleet, tmp_path, fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage)
    )
    holder, waiter = f.start(2)

    async def kill_listeners() -> int:
        conn = await asyncpg.connect(pg_url)
        try:
            return int(
                await conn.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'proxy-session'"
                )
            )
        finally:
            await conn.close()

    assert asyncio.run(kill_listeners()) == 2
    httpx.get(holder.url + "/pypi/simple/big/")
    path = f"/pypi/files/big/{big.filename}"

    async def scenario() -> list[tuple[int, str, int]]:
        first = asyncio.ensure_future(fetch_digests([holder.url + path]))
        await asyncio.to_thread(wait_for_holder, pg_url, FILE_KEY)
        second = await fetch_digests([waiter.url + path])
        return [*(await first), *second]

    results = asyncio.run(scenario())
    assert [status for status, _, _ in results] == [200, 200]
    assert "database session connection lost" in waiter.log()
    assert "database session connection back after" in waiter.log()
    assert waiter.metric("proxy_database_reconnects_total", connection="session") >= 1
    assert waiter.metric("proxy_fetch_lease_notifications_total") >= 1


@pytest.mark.pgbouncer
def test_renewal_blackout_loses_the_lease_and_never_touches_it_again(
    tmp_path: Path, own_postgres: PostgresServer, upstream: FakeUpstream, fleet: Fleets
) -> None:
    big = add_big_file(upstream, 8 * MiB, chunk_size=MiB, chunk_delay_s=1.0)
    db_url = own_postgres.admin_url
    # The fleet's route (straight, or behind a PgBouncer), to this test's own server.
    db, bouncer = behind(fleet.db.route, db_url)
    if bouncer is not None:
        fleet.stopped_after.append(bouncer)
    config = fleet_config(tmp_path, db, upstream.base_url, storage=fleet.storage, ttl="2s")
    [replica] = make_fleet(fleet, tmp_path, config).start(1)
    assert httpx.get(replica.url + "/pypi/simple/big/").status_code == 200
    path = f"/pypi/files/big/{big.filename}"

    async def scenario() -> tuple[tuple[int, str, int], asyncpg.Record]:
        downloading = asyncio.ensure_future(fetch_digests([replica.url + path]))
        row = await asyncio.to_thread(wait_for_holder, db_url, FILE_KEY)
        # Mid-download: once the upstream is sending (the claim's own reads are done).
        while upstream.count(f"/packages/{big.filename}") == 0:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await asyncio.to_thread(own_postgres.stop, "fast")
        await asyncio.sleep(3.5)  # longer than the TTL without a renewal
        await asyncio.to_thread(own_postgres.start)
        [result] = await downloading
        return result, row

    result, claimed = asyncio.run(scenario())
    assert result == (200, hashlib.sha256(big.body).hexdigest(), len(big.body))
    assert "lease lost" in replica.log()
    assert replica.metric("proxy_fetch_lease_losses_total", repository="pypi") >= 1
    row = asyncio.run(lease_row(db_url, FILE_KEY))
    assert row is not None
    # Nothing was marked or released under the lost fence.
    assert (row["fence"], row["state"]) == (claimed["fence"], "fetching")
    assert row["renewed_at"] <= row["expires_at"]
    # Service resumes: new misses work again.
    upstream.add_project("after", [ProjectFile("after-1.0.tar.gz", b"after")])
    assert httpx.get(replica.url + "/pypi/simple/after/", timeout=30).status_code == 200
    # And the verified download was still stored once the database was back.
    assert httpx.get(replica.url + path, timeout=30).content == big.body
    assert upstream.count(f"/packages/{big.filename}") == 1


@pytest.mark.pgbouncer
def test_a_postgres_restart_mid_download_is_ridden_out_by_holder_and_waiter(
    tmp_path: Path, own_postgres: PostgresServer, upstream: FakeUpstream, fleet: Fleets
) -> None:
    """The database restarts while one replica downloads and another waits on its
    lease: an outage shorter than the TTL costs neither its lease (no takeover, one
    upstream GET), nor the waiter its wait; both clients get the file, it is stored,
    and every replica logs the lost and regained session connection and counts it."""
    big = add_big_file(upstream, 8 * MiB, chunk_size=MiB, chunk_delay_s=0.5)
    db_url = own_postgres.admin_url
    db, bouncer = behind(fleet.db.route, db_url)
    if bouncer is not None:
        fleet.stopped_after.append(bouncer)
    # A TTL far longer than a restart, even on a loaded machine.
    config = fleet_config(tmp_path, db, upstream.base_url, storage=fleet.storage, ttl="30s")
    holder, waiter = make_fleet(fleet, tmp_path, config).start(2)
    assert httpx.get(holder.url + "/pypi/simple/big/").status_code == 200
    path = f"/pypi/files/big/{big.filename}"

    async def scenario() -> tuple[list[tuple[int, str, int]], asyncpg.Record]:
        holding = asyncio.ensure_future(fetch_digests([holder.url + path]))
        row = await asyncio.to_thread(wait_for_holder, db_url, FILE_KEY)
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("GET", waiter.url + path) as response:
                chunks = response.aiter_bytes()
                digest = hashlib.sha256(first := await anext(chunks))
                size = len(first)
                # The waiter follows the holder's stream: now the database goes.
                await asyncio.to_thread(own_postgres.stop, "fast")
                await asyncio.to_thread(own_postgres.start)
                async for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
            waited = (response.status_code, digest.hexdigest(), size)
        return [*(await holding), waited], row

    results, claimed = asyncio.run(scenario())
    assert results == [(200, hashlib.sha256(big.body).hexdigest(), len(big.body))] * 2
    assert upstream.count(f"/packages/{big.filename}") == 1
    row = asyncio.run(lease_row(db_url, FILE_KEY))
    assert row is not None
    assert (row["fence"], row["state"]) == (claimed["fence"], "done")  # no takeover
    for replica in (holder, waiter):
        log = replica.log()
        assert "database session connection lost" in log
        assert "database session connection back after" in log
        assert replica.metric("proxy_database_reconnects_total", connection="session") >= 1
    # Stored: the waiter's replica serves it again from the entry, the upstream untouched.
    assert httpx.get(waiter.url + path, timeout=30).content == big.body
    assert upstream.count(f"/packages/{big.filename}") == 1


@pytest.mark.pgbouncer
def test_metadata_with_ttl_zero_takes_no_lease(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    config = fleet_config(
        tmp_path, fleet.db, upstream.base_url, storage=fleet.storage, metadata_ttl="0"
    )
    replicas = make_fleet(fleet, tmp_path, config).start(2)
    for replica in replicas:
        for _ in range(2):
            assert httpx.get(replica.url + "/pypi/simple/alpha/").status_code == 200
    assert upstream.count("/simple/alpha/") == 4

    async def lease_keys() -> list[str]:
        conn = await asyncpg.connect(pg_url)
        try:
            return [r["key"] for r in await conn.fetch("SELECT key FROM fetch_leases")]
        finally:
            await conn.close()

    assert asyncio.run(lease_keys()) == []


@pytest.mark.pgbouncer
def test_reclaim_purges_lease_rows_after_retention(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    config = fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage,
        extra_leases='retention = "1s"', jobs='[jobs]\nreclaim_interval = "1s"',
    )  # fmt: skip
    [replica, other] = make_fleet(fleet, tmp_path, config).start(2)
    assert httpx.get(replica.url + "/pypi/simple/alpha/").status_code == 200
    assert asyncio.run(lease_row(pg_url, "pypi/simple/alpha/")) is not None
    deadline = time.monotonic() + 15
    while asyncio.run(lease_row(pg_url, "pypi/simple/alpha/")) is not None:
        assert time.monotonic() < deadline, "the expired lease row was never purged"
        time.sleep(0.2)
    ran = sum(
        r.metric("proxy_job_runs_total", job="reclaim", outcome="ran") for r in (replica, other)
    )
    assert ran >= 1


def test_build_cache_put_is_durable_and_readable_from_every_replica(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, fleet: Fleets
) -> None:
    config = fleet_config(tmp_path, fleet.db, upstream.base_url, storage=fleet.storage,
        extra='[[repositories]]\nname = "gradle-cache"\nformat = "gradle-build-cache"\nanonymous = "write"',
    )  # fmt: skip
    a, b = make_fleet(fleet, tmp_path, config).start(2)
    body = os.urandom(200_000)
    assert httpx.put(a.url + "/gradle-cache/key1", content=body).status_code == 201
    # Acknowledged means durable: even if the writer dies at once, others serve it.
    a.signal(signal.SIGKILL)
    assert httpx.get(b.url + "/gradle-cache/key1").content == body
    replaced = os.urandom(1000)
    assert httpx.put(b.url + "/gradle-cache/key1", content=replaced).status_code == 201
    [c] = make_fleet(fleet, tmp_path, config).start(1)
    assert httpx.get(c.url + "/gradle-cache/key1").content == replaced
    assert httpx.get(b.url + "/gradle-cache/key1").content == replaced

"""Fetch lease semantics (docs/architecture.md) on both catalog backends, and the coordinator."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import asyncpg
import pytest

from proxy.catalog import (
    Catalog,
    Entry,
    LeaseGrant,
    LeaseRow,
    StreamInfo,
    migrations_dir,
    open_catalog,
)
from proxy.catalog.postgres import PostgresCatalog
from proxy.catalog.queries import load
from proxy.clock import SYSTEM_CLOCK, ManualClock
from proxy.config.settings import DatabaseSettings, LeaseSettings
from proxy.fetch.leases import LeaseCoordinator, Verdict
from proxy.runtime.tasks import TaskSupervisor
from proxy.types import Kind
from tests.conftest import pass_time
from tests.tcp_relay import Relay

pg_sql = load("postgres")
now_ms = SYSTEM_CLOCK.now_ms

pytestmark = pytest.mark.anyio


async def test_racing_claims_have_one_winner(database_url: str) -> None:
    # Separate catalogs: separate connections, as separate processes would have.
    catalogs = [open_catalog(database_url) for _ in range(8)]
    await catalogs[0].migrate()
    try:
        for round_ in range(5):
            key = f"race-{round_}"
            grants = await asyncio.gather(
                *(c.claim_lease(key, f"holder-{i}", 30) for i, c in enumerate(catalogs))
            )
            winners = [g for g in grants if g is not None]
            assert len(winners) == 1, grants
            row = await catalogs[0].get_lease(key)
            assert row is not None
            assert (row.holder, row.fence, row.state) == (
                winners[0].holder,
                winners[0].fence,
                "fetching",
            )
    finally:
        for c in catalogs:
            await c.close()


async def test_live_lease_of_another_holder_is_not_claimable(catalog: Catalog) -> None:
    assert await catalog.claim_lease("k", "a", 30) is not None
    assert await catalog.claim_lease("k", "b", 30) is None


async def test_a_claim_after_the_holder_stored_the_entry_gets_nothing(
    catalog: Catalog, clock: ManualClock
) -> None:
    held = await catalog.claim_lease("r/k", "a", 30)
    assert held is not None
    at = clock.now_ms()
    await catalog.put_entry(Entry("r", "k", Kind.METADATA, "a" * 64, 1, None, at, at + 60_000))
    assert await catalog.release_lease(held, "done")
    # Claimable as a row, but the entry it was for is stored and fresh: nothing.
    assert await catalog.claim_lease("r/k", "b", 30, unless_fresh=("r", "k", at)) is None
    row = await catalog.get_lease("r/k")
    assert row is not None and (row.holder, row.state) == ("a", "done")
    # Once the entry has expired, the claim is a refresh like any other.
    later = await catalog.claim_lease("r/k", "b", 30, unless_fresh=("r", "k", at + 60_000))
    assert later is not None and later.fence > held.fence
    # Another key of the repository, or no entry named, is not held back by it.
    assert await catalog.claim_lease("r/k2", "b", 30, unless_fresh=("r", "k2", at)) is not None


async def test_an_absent_or_expired_lease_with_a_fresh_entry_is_not_claimed(
    catalog: Catalog, clock: ManualClock
) -> None:
    at = clock.now_ms()
    await catalog.put_entry(Entry("r", "k", Kind.IMMUTABLE, "a" * 64, 1, None, at, None))
    assert await catalog.claim_lease("r/k", "b", 30, unless_fresh=("r", "k", at)) is None
    assert await catalog.get_lease("r/k") is None  # not even a row was written
    dead = await catalog.claim_lease("r/other", "dead", 0.2)
    assert dead is not None
    await catalog.put_entry(Entry("r", "other", Kind.IMMUTABLE, "b" * 64, 1, None, at, None))
    await pass_time(catalog, clock, 0.3)
    assert await catalog.claim_lease("r/other", "b", 30, unless_fresh=("r", "other", at)) is None


@pytest.mark.postgres
async def test_a_claim_that_loses_writes_nothing(pg_url: str) -> None:
    catalog = open_catalog(pg_url)
    await catalog.migrate()
    conn = await asyncpg.connect(pg_url)
    try:
        assert await catalog.claim_lease("k", "a", 30) is not None
        xmax = await conn.fetchval("SELECT xmax::text FROM fetch_leases WHERE key = 'k'")
        next_xid = "SELECT pg_snapshot_xmax(pg_current_snapshot())::text"
        before = await conn.fetchval(next_xid)
        for holder in ("b", "c", "d"):
            assert await catalog.claim_lease("k", holder, 30) is None
        # No row lock was taken (the row's xmax is unchanged) and no transaction ID
        # was assigned: a losing claim is a read.
        assert await conn.fetchval("SELECT xmax::text FROM fetch_leases WHERE key = 'k'") == xmax
        assert await conn.fetchval(next_xid) == before
    finally:
        await conn.close()
        await catalog.close()


async def test_fence_grows_on_every_claim_including_reentrant(catalog: Catalog) -> None:
    first = await catalog.claim_lease("k", "a", 30)
    again = await catalog.claim_lease("k", "a", 30)
    assert first is not None and again is not None
    assert again.fence > first.fence


async def test_late_release_and_renewal_of_an_earlier_mandate_change_nothing(
    catalog: Catalog,
) -> None:
    mandate_n = await catalog.claim_lease("k", "a", 30)
    mandate_n1 = await catalog.claim_lease("k", "a", 30)  # re-entrant: same holder, new fence
    assert mandate_n is not None and mandate_n1 is not None
    assert not await catalog.renew_lease(mandate_n, 30)
    assert not await catalog.release_lease(mandate_n, "done")
    row = await catalog.get_lease("k")
    assert row is not None
    assert (row.fence, row.state, row.expired) == (mandate_n1.fence, "fetching", False)
    assert await catalog.renew_lease(mandate_n1, 30)


async def test_expired_lease_is_taken_over_and_the_old_holder_is_fenced_off(
    catalog: Catalog, clock: ManualClock
) -> None:
    old = await catalog.claim_lease("k", "a", 0.2)
    assert old is not None
    assert await catalog.claim_lease("k", "b", 30) is None
    await pass_time(catalog, clock, 0.3)
    row = await catalog.get_lease("k")
    assert row is not None and row.expired
    new = await catalog.claim_lease("k", "b", 30)
    assert new is not None and new.fence > old.fence
    assert not await catalog.renew_lease(old, 30)
    assert not await catalog.release_lease(old, "failed")
    row = await catalog.get_lease("k")
    assert row is not None and (row.holder, row.state) == ("b", "fetching")


async def test_release_expires_in_place_with_its_final_state(catalog: Catalog) -> None:
    for state in ("done", "failed", "released"):
        key = f"k-{state}"
        grant = await catalog.claim_lease(key, "a", 30)
        assert grant is not None
        assert await catalog.release_lease(grant, state)
        row = await catalog.get_lease(key)
        assert row is not None, "release must keep the row (and its fence)"
        assert (row.state, row.expired, row.fence) == (state, True, grant.fence)
        assert not await catalog.release_lease(grant, state)  # only once
        successor = await catalog.claim_lease(key, "b", 30)
        assert successor is not None and successor.fence > grant.fence


async def test_purged_key_gets_a_larger_fence_than_ever_before(
    catalog: Catalog, clock: ManualClock
) -> None:
    fences = []
    for _ in range(3):
        grant = await catalog.claim_lease("k", "a", 30)
        assert grant is not None
        fences.append(grant.fence)
        await catalog.release_lease(grant, "done")
    await pass_time(catalog, clock, 0.01)
    assert await catalog.purge_leases(0) >= 1
    assert await catalog.get_lease("k") is None
    after = await catalog.claim_lease("k", "a", 30)
    assert after is not None and after.fence > max(fences)


async def test_purge_keeps_rows_within_retention(catalog: Catalog, clock: ManualClock) -> None:
    grant = await catalog.claim_lease("k", "a", 30)
    assert grant is not None
    await catalog.release_lease(grant, "done")
    assert await catalog.purge_leases(3600) == 0
    live = await catalog.claim_lease("live", "a", 30)
    assert live is not None
    await pass_time(catalog, clock, 0.01)
    assert await catalog.purge_leases(0) == 1  # the released one; the live one stays
    assert await catalog.get_lease("live") is not None


async def test_postgres_lease_times_use_clock_timestamp(pg_url: str) -> None:
    """A claim inside a transaction that began earlier must expire TTL after the claim.

    With now() (the transaction's start) the lease below would already be expired.
    """
    catalog = open_catalog(pg_url)
    await catalog.migrate()
    await catalog.close()
    conn = await asyncpg.connect(pg_url)
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_sleep(1.0)")
            fence = await conn.fetchval(pg_sql["claim_lease"], "k", "a", 1.5, *[None] * 5)
            assert fence is not None
            remaining = await conn.fetchval(
                "SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM fetch_leases WHERE key = 'k'"
            )
            assert remaining > 1.0
            renewed = await conn.execute(pg_sql["renew_lease"], "k", "a", fence, 1.5, None, None)
            assert renewed == "UPDATE 1"
            await conn.execute(pg_sql["release_lease"], "k", "a", fence, "done")
            expired_lag = await conn.fetchval(
                "SELECT extract(epoch FROM clock_timestamp() - expires_at) FROM fetch_leases WHERE key = 'k'"
            )
            assert 0 <= expired_lag < 0.5
    finally:
        await conn.close()


async def test_postgres_schema_has_the_expiry_check(pg_url: str) -> None:
    catalog = open_catalog(pg_url)
    await catalog.migrate()
    await catalog.close()
    conn = await asyncpg.connect(pg_url)
    try:
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "INSERT INTO fetch_leases VALUES ('k', 'a', 1, 'fetching', clock_timestamp(), "
                "clock_timestamp(), clock_timestamp() - interval '1 second')"
            )
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "INSERT INTO fetch_leases VALUES ('k', 'a', 1, 'stolen', clock_timestamp(), "
                "clock_timestamp(), clock_timestamp())"
            )
    finally:
        await conn.close()


# -- the coordinator -------------------------------------------------------------------


def _coordinator(
    catalog: Catalog, holder: str, ttl_s: float = 3.0
) -> tuple[LeaseCoordinator, TaskSupervisor]:
    tasks = TaskSupervisor()
    settings = LeaseSettings(ttl_s=ttl_s, poll_interval_s=0.05, retention_s=3600)
    return LeaseCoordinator(catalog, settings, tasks, holder), tasks


async def no_stream(stream: StreamInfo, fence: int) -> None:
    raise AssertionError(f"nothing was announced, yet {stream} was handed on")


async def test_holder_renews_while_it_works(catalog: Catalog) -> None:
    coordinator, tasks = _coordinator(catalog, "a", ttl_s=0.6)
    held = await coordinator.claim("r", "k")
    assert held is not None
    await asyncio.sleep(1.5)  # more than two TTLs
    row = await catalog.get_lease("r/k")
    assert row is not None and not row.expired and row.fence == held.fence
    assert not held.lost
    await held.release("done")
    await tasks.close(1)


async def test_wait_ends_with_the_entry_the_holder_stored(catalog: Catalog) -> None:
    holder, holder_tasks = _coordinator(catalog, "a")
    waiter, waiter_tasks = _coordinator(catalog, "b")
    held = await holder.claim("r", "k")
    assert held is not None
    assert await waiter.claim("r", "k") is None
    at = now_ms()
    entry = Entry("r", "k", Kind.IMMUTABLE, "a" * 64, 1, None, at, None, last_access_ms=at)

    async def find() -> Entry | None:
        return await catalog.get_entry("r", "k")

    async def finish() -> None:
        await asyncio.sleep(0.2)
        await catalog.put_entry(entry)
        await held.release("done")

    finishing = asyncio.ensure_future(finish())
    result = await asyncio.wait_for(waiter.wait("r", "k", find, no_stream), 5)
    await finishing
    assert result.verdict is Verdict.ENTRY and result.entry == entry
    await holder_tasks.close(1)
    await waiter_tasks.close(1)


@pytest.mark.parametrize(
    ("state", "verdict"), [("failed", Verdict.FAILED), ("released", Verdict.TAKEOVER)]
)
async def test_wait_ends_on_failed_or_released(
    catalog: Catalog, state: str, verdict: Verdict
) -> None:
    holder, holder_tasks = _coordinator(catalog, "a")
    waiter, waiter_tasks = _coordinator(catalog, "b")
    held = await holder.claim("r", "k")
    assert held is not None

    async def find() -> Entry | None:
        return None

    async def finish() -> None:
        await asyncio.sleep(0.2)
        await held.release(state)

    finishing = asyncio.ensure_future(finish())
    result = await asyncio.wait_for(waiter.wait("r", "k", find, no_stream), 5)
    await finishing
    assert result.verdict is verdict and result.fence == held.fence
    await holder_tasks.close(1)
    await waiter_tasks.close(1)


async def test_wait_takes_over_when_the_holder_stops_renewing(
    catalog: Catalog, clock: ManualClock
) -> None:
    grant = await catalog.claim_lease("r/k", "dead-process", 0.5)
    assert grant is not None
    waiter, tasks = _coordinator(catalog, "b")

    async def find() -> Entry | None:
        return None

    waiting = asyncio.ensure_future(waiter.wait("r", "k", find, no_stream))
    await asyncio.sleep(0.3)  # several polls (every 50 ms): the lease is still live
    assert not waiting.done(), "it must wait for the expiry, not less"
    await pass_time(catalog, clock, 0.5)
    result = await asyncio.wait_for(waiting, 5)
    assert result.verdict is Verdict.TAKEOVER
    held = await waiter.claim("r", "k")
    assert held is not None and held.fence > grant.fence
    await held.release("done")
    await tasks.close(1)


async def test_lost_lease_is_never_released(catalog: Catalog) -> None:
    coordinator, tasks = _coordinator(catalog, "a", ttl_s=30)
    held = await coordinator.claim("r", "k")
    assert held is not None
    # Someone else's claim wins after an expiry we slept through (simulated by a
    # re-entrant claim under our own holder name: the fence moves on either way).
    successor = await catalog.claim_lease("r/k", "a", 30)
    assert successor is not None
    await held.release("failed")
    row = await catalog.get_lease("r/k")
    assert row is not None and (row.fence, row.state) == (successor.fence, "fetching")
    await tasks.close(1)


async def test_release_all_hands_back_every_held_lease(catalog: Catalog) -> None:
    coordinator, tasks = _coordinator(catalog, "a")
    for key in ("k1", "k2", "k3"):
        assert await coordinator.claim("r", key) is not None
    await coordinator.release_all()
    for key in ("k1", "k2", "k3"):
        row = await catalog.get_lease(f"r/{key}")
        assert row is not None and row.state == "released" and row.expired
    await tasks.close(1)


def test_lease_grant_is_a_value() -> None:
    assert LeaseGrant("k", "a", 1) == LeaseGrant("k", "a", 1)


# -- waiting with notifications (Postgres) -------------------------------------------


class CountingCatalog(PostgresCatalog):
    """The Postgres catalog, counting the lease rows a waiter reads."""

    reads = 0

    async def get_lease(self, key: str) -> LeaseRow | None:
        self.reads += 1
        return await super().get_lease(key)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def listening_waiter(
    pg_url: str, session_url: str | None = None
) -> tuple[CountingCatalog, LeaseCoordinator, TaskSupervisor]:
    """A waiter whose own TTL is 30 s: it reads the row every 10 s while notifications
    arrive, every 100 ms while they do not."""
    catalog = CountingCatalog(
        pg_url,
        migrations_dir() / "postgres",
        SYSTEM_CLOCK,
        DatabaseSettings(session_url=session_url),
    )
    await catalog.migrate()
    tasks = TaskSupervisor()
    settings = LeaseSettings(ttl_s=30, poll_interval_s=0.1, retention_s=3600)
    coordinator = LeaseCoordinator(catalog, settings, tasks, "waiter")
    tasks.spawn("listener", catalog.listen_leases(coordinator.notify, coordinator.set_listening))
    await until(lambda: coordinator.listening, "never listened")
    return catalog, coordinator, tasks


@pytest.mark.postgres
async def test_a_listening_waiter_follows_the_stream_and_the_outcome_without_reading(
    pg_url: str,
) -> None:
    catalog, waiter, tasks = await listening_waiter(pg_url)
    holder = open_catalog(pg_url)
    streams: list[StreamInfo] = []

    async def on_stream(stream: StreamInfo, fence: int) -> None:
        streams.append(stream)

    try:
        grant = await holder.claim_lease("r/k", "holder", 30)
        assert grant is not None
        waiting = asyncio.ensure_future(
            waiter.wait("r", "k", lambda: catalog.get_entry("r", "k"), on_stream)
        )
        await until(lambda: catalog.reads == 1, "the waiter did not look")
        stream = StreamInfo("0" * 32 + ".part", "application/gzip", 1234)
        assert await holder.announce_stream(grant, stream)
        await until(lambda: streams == [stream], "the announced file was not handed on")
        at = now_ms()
        entry = Entry("r", "k", Kind.IMMUTABLE, "a" * 64, 1234, None, at, None, last_access_ms=at)
        await holder.put_entry(entry)
        assert await holder.release_lease(grant, "done")
        result = await asyncio.wait_for(waiting, 5)  # sooner than one 10 s pace
        assert result.verdict is Verdict.ENTRY and result.entry == entry
        # One read of the row when the wait began; the stream and the outcome came
        # with their notifications.
        assert catalog.reads == 1
        assert streams == [stream]
    finally:
        await tasks.close(5)
        await catalog.close()
        await holder.close()


@pytest.mark.postgres
async def test_a_listening_waiter_looks_when_the_lease_would_expire(pg_url: str) -> None:
    catalog, waiter, tasks = await listening_waiter(pg_url)
    try:
        assert await catalog.claim_lease("r/k", "dead-holder", 1.0) is not None
        result = await asyncio.wait_for(
            waiter.wait("r", "k", lambda: catalog.get_entry("r", "k"), no_stream), 6
        )
        assert result.verdict is Verdict.TAKEOVER  # at the expiry, not at the 10 s pace
    finally:
        await tasks.close(5)
        await catalog.close()


@pytest.mark.postgres
async def test_a_notification_after_the_read_keeps_the_expiry_the_read_saw(pg_url: str) -> None:
    # CI: the claim's notification arrived after the waiter's first read; it carries no
    # expiry, and the waiter slept a whole pace (10 s) past the dead holder's 1 s lease.
    catalog, waiter, tasks = await listening_waiter(pg_url)
    try:
        grant = await catalog.claim_lease("r/k", "dead-holder", 1.0)
        assert grant is not None
        waiting = asyncio.ensure_future(
            waiter.wait("r", "k", lambda: catalog.get_entry("r", "k"), no_stream)
        )
        await until(lambda: catalog.reads >= 1, "the waiter did not look")
        waiter.notify("r/k", LeaseRow("r/k", "dead-holder", grant.fence, "fetching", False))
        result = await asyncio.wait_for(waiting, 6)
        assert result.verdict is Verdict.TAKEOVER
    finally:
        await tasks.close(5)
        await catalog.close()


@pytest.mark.postgres
async def test_waiters_poll_while_the_listener_is_cut_off_and_stop_when_it_is_back(
    pg_url: str, postgres_admin_url: str
) -> None:
    port = int(postgres_admin_url.rsplit(":", 1)[1].split("/")[0])
    relay = Relay(port).start()
    database = pg_url.rpartition("/")[2]
    catalog, waiter, tasks = await listening_waiter(pg_url, session_url=relay.url(database))
    holder = open_catalog(pg_url)
    try:
        grant = await holder.claim_lease("r/k", "holder", 30)
        assert grant is not None
        waiting = asyncio.ensure_future(
            waiter.wait("r", "k", lambda: catalog.get_entry("r", "k"), no_stream)
        )
        await until(lambda: catalog.reads == 1, "the waiter did not look")
        relay.cut()  # the listener's connection drops and cannot come back yet
        await until(lambda: not waiter.listening, "the loss went unnoticed")
        await until(lambda: catalog.reads >= 5, "the waiter did not poll")  # 100 ms each
        # The outcome while nothing is notified: the poll finds it.
        assert await holder.release_lease(grant, "released")
        result = await asyncio.wait_for(waiting, 5)
        assert result.verdict is Verdict.TAKEOVER
        relay.restore()
        await until(lambda: waiter.listening, "the listener did not come back")
    finally:
        relay.stop()
        await tasks.close(5)
        await catalog.close()
        await holder.close()


async def test_a_late_notification_of_an_earlier_mandate_changes_nothing(
    catalog: Catalog, clock: ManualClock
) -> None:
    waiter, tasks = _coordinator(catalog, "b", ttl_s=30)  # polls every 50 ms: no listener
    first = await catalog.claim_lease("r/k", "dead", 0.01)
    assert first is not None
    await pass_time(catalog, clock, 0.05)
    second = await catalog.claim_lease("r/k", "a", 30)
    assert second is not None
    waiting = asyncio.ensure_future(
        waiter.wait("r", "k", lambda: catalog.get_entry("r", "k"), no_stream)
    )
    await asyncio.sleep(0.1)
    # The release of the first mandate, delivered late: the wait goes on.
    waiter.notify("r/k", LeaseRow("r/k", "dead", first.fence, "released", expired=False))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    waiter.notify("r/k", LeaseRow("r/k", "a", second.fence, "failed", expired=False))
    result = await asyncio.wait_for(waiting, 5)
    assert result.verdict is Verdict.FAILED and result.fence == second.fence
    await tasks.close(1)


# -- a database clock that steps back (issue 18) -----------------------------------------


async def test_a_lease_the_database_calls_live_but_nobody_renews_is_taken_over(
    catalog: Catalog,
) -> None:
    # A holder killed just after the database's clock stepped back an hour: its lease
    # "expires" an hour from now. Claimed here for an hour, which the database sees the
    # same way. The waiter, whose TTL is 0.5 s, sees no renewal for a TTL by its own
    # monotonic clock and takes over, at once, not an hour later.
    dead = await catalog.claim_lease("r/k", "dead", 3600)
    assert dead is not None
    waiter, tasks = _coordinator(catalog, "b", ttl_s=0.5)
    try:
        result = await asyncio.wait_for(
            waiter.wait("r", "k", lambda: catalog.get_entry("r", "k"), no_stream), 10
        )
        assert result.verdict is Verdict.TAKEOVER and result.fence == dead.fence
        assert result.unrenewed is not None and result.unrenewed[0] == dead.fence
        # Without the stamp the claim loses (the database calls the lease live) ...
        assert await waiter.claim("r", "k", unless_stored=False) is None
        # ... with it, it wins, and the dead mandate is over: it can renew nothing.
        held = await waiter.claim("r", "k", unless_stored=False, unrenewed=result.unrenewed)
        assert held is not None and held.fence > dead.fence
        assert not await catalog.renew_lease(dead, 3600)
        # A stamp is good once: it names a row that is no longer there.
        assert await catalog.claim_lease("r/k", "c", 30, unrenewed=result.unrenewed) is None
        await held.release("released")
    finally:
        await tasks.close(2)


async def test_a_holder_that_renews_is_never_taken_over_for_want_of_a_renewal(
    catalog: Catalog, clock: ManualClock
) -> None:
    holder, holder_tasks = _coordinator(catalog, "a", ttl_s=0.5)
    waiter, tasks = _coordinator(catalog, "b", ttl_s=0.5)

    async def tick() -> None:  # the SQLite and in-memory catalogs' clock moves too
        for _ in range(500):
            clock.advance(0.01)
            await asyncio.sleep(0.01)

    ticking = asyncio.ensure_future(tick())
    try:
        held = await holder.claim("r", "k")
        assert held is not None
        waiting = asyncio.ensure_future(
            waiter.wait("r", "k", lambda: catalog.get_entry("r", "k"), no_stream)
        )
        await asyncio.sleep(2.0)  # four TTLs of renewals
        assert not waiting.done(), "a holder that renews was taken over"
        await held.release("released")
        result = await asyncio.wait_for(waiting, 10)
        assert result.verdict is Verdict.TAKEOVER and result.unrenewed is None
    finally:
        ticking.cancel()
        await holder_tasks.close(2)
        await tasks.close(2)

"""The Catalog protocol on both backends: entries, links, usage, jobs."""

from __future__ import annotations

import asyncio
import json

import pytest

from proxy.cache.proxied import CatalogLinks
from proxy.catalog import Catalog, Entry, JobRun, open_catalog
from proxy.clock import SYSTEM_CLOCK
from proxy.types import Kind, Link, LinkBatch

now_ms = SYSTEM_CLOCK.now_ms

pytestmark = pytest.mark.anyio


def _entry(key: str, sha: str | None = "a" * 64, size: int = 10, **kw: object) -> Entry:
    at = now_ms()
    fields: dict[str, object] = dict(
        repository="r",
        key=key,
        kind=Kind.IMMUTABLE,
        sha256=sha,
        size=size,
        content_type="application/octet-stream",
        fetched_at_ms=at,
        expires_at_ms=None,
        digests={"sha256": sha, "sha1": "b" * 40},
        last_access_ms=at,
    )
    fields.update(kw)
    return Entry(**fields)  # type: ignore[arg-type]


async def test_a_migrated_catalog_has_no_pending_migrations(catalog: Catalog) -> None:
    assert await catalog.pending_migrations() == []


async def test_an_empty_database_holds_no_catalog_and_asking_creates_none(
    database_url: str,
) -> None:
    fresh = open_catalog(database_url)
    try:
        assert await fresh.pending_migrations() is None
        assert await fresh.pending_migrations() is None  # asking created nothing
        await fresh.migrate()
        assert await fresh.pending_migrations() == []
    finally:
        await fresh.close()


async def test_entry_round_trip_and_upsert(catalog: Catalog) -> None:
    assert await catalog.get_entry("r", "k") is None
    entry = _entry("k", etag='"e1"', last_modified="Mon, 01 Jan 2024 00:00:00 GMT")
    await catalog.put_entry(entry)
    assert await catalog.get_entry("r", "k") == entry
    await catalog.put_entry(entry)  # idempotent
    replaced = _entry("k", sha="c" * 64, size=20)
    await catalog.put_entry(replaced)
    got = await catalog.get_entry("r", "k")
    assert got is not None
    assert got.sha256 == "c" * 64
    assert got.size == 20


async def test_refresh_delete_and_conditional_delete(catalog: Catalog) -> None:
    entry = _entry("m", kind=Kind.METADATA, expires_at_ms=now_ms() - 1)
    await catalog.put_entry(entry)
    refreshed = entry.refreshed(now_ms(), now_ms() + 60_000, '"new"', None)
    await catalog.refresh_entry(refreshed)
    got = await catalog.get_entry("r", "m")
    assert got is not None and got.is_fresh(now_ms()) and got.etag == '"new"'
    assert not await catalog.delete_entry("r", "m", "f" * 64)  # points elsewhere now? no
    assert await catalog.delete_entry("r", "m", entry.sha256)
    assert await catalog.get_entry("r", "m") is None


async def test_touch_usage_and_least_recently_used(catalog: Catalog) -> None:
    for i in range(5):
        await catalog.put_entry(_entry(f"k{i}", sha=str(i) * 64, size=100, last_access_ms=1000 + i))
    await catalog.put_entry(_entry("neg", kind=Kind.NEGATIVE, sha=None, size=0, expires_at_ms=1))
    await catalog.touch_entries([("r", "k0", now_ms()), ("r", "missing", now_ms())])
    usage = await catalog.usage("r")
    assert usage.entries == 6 and usage.bytes == 500
    order = [e.key for e in await catalog.least_recently_used("r", 10)]
    assert order == ["k1", "k2", "k3", "k4", "k0"]  # negatives are not evicted as data
    assert await catalog.unreferenced_blobs(["1" * 64, "9" * 64]) == {"9" * 64}
    assert await catalog.unreferenced_blobs([]) == set()
    assert await catalog.delete_expired_negatives(now_ms()) == 1


async def test_links(catalog: Catalog) -> None:
    links = [
        Link("r", f"files/p/f{i}.whl", f"https://upstream.example/f{i}.whl", {"sha256": "0" * 64})
        for i in range(3)
    ]
    await catalog.put_links(links)
    await catalog.put_links([Link("r", "files/p/f0.whl", "https://upstream.example/moved.whl", {})])
    got = await catalog.get_link("r", "files/p/f0.whl")
    assert got == Link("r", "files/p/f0.whl", "https://upstream.example/moved.whl", {})
    assert await catalog.get_link("r", "files/p/f1.whl") == links[1]
    assert await catalog.get_link("other", "files/p/f1.whl") is None


async def test_a_repository_link_store_records_only_its_own_links(catalog: Catalog) -> None:
    """What ``contract.LinkStore`` promises, for a list and for an encoded batch alike: a
    format cannot make one repository fetch URLs another repository's page listed."""
    store = CatalogLinks(catalog, "r")
    foreign = [
        Link("r", "files/p/ok.whl", "https://upstream.example/ok.whl", {}),
        Link("other", "files/p/f.whl", "https://upstream.example/f.whl", {}),
    ]
    for links in (foreign, LinkBatch.encode(foreign)):
        with pytest.raises(ValueError, match="name another repository: other"):
            await store.record(links)
    assert await catalog.get_link("r", "files/p/ok.whl") is None
    assert await catalog.get_link("other", "files/p/f.whl") is None
    await store.record(LinkBatch.encode(foreign[:1]))
    assert await store.get("files/p/ok.whl") == foreign[0]


async def test_publish_times_first_seen_once_and_upstream_times_kept(catalog: Catalog) -> None:
    """The release policy's publish times (docs/architecture.md, "Release policy"): a
    key's first sight is recorded once and never reset, also when its entry goes; an
    upstream's time, once learnt, stays."""

    async def first_seen(repository: str, keys: list[str], at_ms: int) -> dict[str, int]:
        seen: dict[str, int] = json.loads(
            await catalog.record_first_sight(repository, json.dumps(keys), at_ms)
        )
        return seen

    assert await first_seen("r", [], 1) == {}
    seen = await first_seen("r", ["files/p/a.whl", "files/p/b.whl"], 1000)
    assert seen == {"files/p/a.whl": 1000, "files/p/b.whl": 1000}
    await catalog.put_entry(_entry("files/p/a.whl"))
    await catalog.delete_entry("r", "files/p/a.whl", None)
    again = await first_seen("r", ["files/p/a.whl", "files/p/c.whl"], 5000)
    assert again == {"files/p/a.whl": 1000, "files/p/c.whl": 5000}  # never reset
    assert await first_seen("other", ["files/p/a.whl"], 7000) == {"files/p/a.whl": 7000}
    await catalog.record_upstream_time("r", "g/a/1/a-1.pom", 300, 9000)
    await catalog.record_upstream_time("r", "g/a/1/a-1.pom", 400, 9500)  # the first stays
    await catalog.record_upstream_time("r", "files/p/a.whl", 200, 9000)
    known = await catalog.known_times("r", ["g/a/1/a-1.pom", "files/p/a.whl", "absent"])
    assert known["g/a/1/a-1.pom"].upstream_ms == 300
    assert known["g/a/1/a-1.pom"].first_seen_ms == 9000
    assert (known["files/p/a.whl"].first_seen_ms, known["files/p/a.whl"].upstream_ms) == (
        1000,
        200,
    )
    assert "absent" not in known


async def test_job_runs_once_per_interval_and_give_back(catalog: Catalog) -> None:
    # Claims are made under the job's lock, so each pass ends (ok or given back) first.
    first = await catalog.claim_job_run("j", 3600, "a")
    assert first is not None
    await catalog.finish_job_run("j", first, "ok")
    assert await catalog.claim_job_run("j", 3600, "b") is None
    await catalog.give_back_job_run("j", first)
    second = await catalog.claim_job_run("j", 3600, "b")
    assert second is not None and second > first
    await catalog.finish_job_run("j", second, "ok")
    assert await catalog.claim_job_run("j", 0.0, "c") is not None  # due again at once


@pytest.mark.parametrize("job", ["evict", "mirror:nightly"])  # hashtext >= 0, and < 0
async def test_a_run_whose_pass_died_is_abandoned_and_claimed_again(
    catalog: Catalog, job: str
) -> None:
    async def last_run() -> JobRun:
        runs, _now = await catalog.job_runs()
        [run] = [r for r in runs if r.name == job]
        return run

    async with catalog.job_lock(job) as got:
        assert got
        first = await catalog.claim_job_run(job, 3600, "a")
        assert first is not None
        await catalog.finish_job_run(job, first, "ok")
    async with catalog.job_lock(job) as got:
        assert got
        second = await catalog.claim_job_run(job, 3600, "a")
        assert second is None  # not due: the interval has not passed
        await catalog.give_back_job_run(job, first)  # as if its pass had been cut off
        second = await catalog.claim_job_run(job, 3600, "a")
        assert second is not None
        running = await last_run()
        assert (running.outcome, running.abandoned) == ("running", False)  # its lock is held
    # The pass's lock went (its process or connection died) without an outcome.
    dead = await last_run()
    assert (dead.run_id, dead.outcome, dead.abandoned) == (second, "running", True)
    async with catalog.job_lock(job) as got:
        assert got
        third = await catalog.claim_job_run(job, 3600, "b")  # at once, not an interval later
        assert third is not None and third > second
        await catalog.give_back_job_run(job, third)
    # Giving the new run back makes the job due as before the dead pass's claim.
    async with catalog.job_lock(job) as got:
        assert got
        assert await catalog.claim_job_run(job, 3600, "c") is not None


async def test_job_lock_is_exclusive(database_url: str) -> None:
    a, b = open_catalog(database_url), open_catalog(database_url)
    await a.migrate()
    try:
        async with a.job_lock("sweep") as got_a:
            assert got_a
            async with b.job_lock("sweep") as got_b:
                assert not got_b
        async with b.job_lock("sweep") as got_b:
            assert got_b
    finally:
        await a.close()
        await b.close()


async def test_concurrent_migrations_apply_once(database_url: str) -> None:
    catalogs = [open_catalog(database_url) for _ in range(4)]
    try:
        results = await asyncio.gather(*(c.migrate() for c in catalogs))
        applied = [names for names in results if names]
        assert len(applied) == 1
        assert applied[0][0] == "0001_init"
        assert [
            c for c in catalogs if c.backend == "sqlite"
        ] == [] or "0002_job_locks_by_file" in applied[0]
    finally:
        for c in catalogs:
            await c.close()


async def test_stored_blobs_in_keyset_pages_and_a_corrupt_blobs_entries_deleted(
    catalog: Catalog,
) -> None:
    # Blobs verified when read: the scrub's walk, proxy verify's totals, the quarantine.
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    await catalog.put_entry(_entry("one", sha=b, size=20))
    await catalog.put_entry(_entry("two", sha=b, size=20))
    await catalog.put_entry(_entry("three", sha=a, size=10))
    await catalog.put_entry(_entry("four", sha=c, size=30, repository="other"))
    await catalog.put_entry(_entry("neg", sha=None, size=0, kind=Kind.NEGATIVE))
    assert await catalog.stored_blobs("", 2) == [(a, 10), (b, 20)]
    assert await catalog.stored_blobs(b, 2) == [(c, 30)]
    assert await catalog.stored_blobs(c, 2) == []
    assert await catalog.stored_blob_totals() == (3, 60)
    assert await catalog.blob_entries(b, 10) == [("r", "one"), ("r", "two")]
    assert await catalog.blob_entries(b, 1) == [("r", "one")]
    removed = await catalog.delete_blob_entries(b)
    assert sorted((r.repository, r.key, r.sha256, r.size) for r in removed) == [
        ("r", "one", b, 20),
        ("r", "two", b, 20),
    ]
    assert await catalog.get_entry("r", "one") is None
    assert await catalog.get_entry("r", "three") is not None
    assert await catalog.stored_blobs("", 10) == [(a, 10), (c, 30)]
    assert (b, 20) in await catalog.due_tombstones(0.0, "", 10)  # tombstoned as any deletion
    assert await catalog.delete_blob_entries(b) == []


async def test_a_jobs_cursor_is_kept_across_its_runs(catalog: Catalog) -> None:
    assert await catalog.job_cursor("scrub") is None
    run = await catalog.claim_job_run("scrub", 3600, "a")
    assert run is not None
    await catalog.save_job_cursor("scrub", "ab" * 32)
    assert await catalog.job_cursor("scrub") == "ab" * 32
    await catalog.give_back_job_run("scrub", run)  # cut off: the next pass resumes there
    again = await catalog.claim_job_run("scrub", 3600, "b")
    assert again is not None
    assert await catalog.job_cursor("scrub") == "ab" * 32
    await catalog.save_job_cursor("scrub", None)  # a round complete
    await catalog.finish_job_run("scrub", again, "ok")
    assert await catalog.job_cursor("scrub") is None

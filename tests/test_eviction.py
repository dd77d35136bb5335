"""Eviction by size, retention by age and the blob grace period, through the engine
(docs/architecture.md, "Eviction and retention"). Time is a ManualClock; Postgres
judges tombstone ages by its own clock, so there the grace is really waited out."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.contract import ProxyCache
from proxy.engine import Engine, open_engine
from proxy.formats.pypi import PypiRepository
from proxy.jobs import Job
from tests.conftest import pypi_config, write_config
from tests.upstream import FakeUpstream, ProjectFile

pytestmark = pytest.mark.anyio

KB = 1000
GRACE_S = 0.5


@asynccontextmanager
async def engine_for(
    tmp_path: Path,
    upstream: FakeUpstream,
    clock: ManualClock,
    database_url: str,
    storage: str = "",
    repo_extra: str = "",
) -> AsyncIterator[Engine]:
    extra = f'[database]\nurl = "{database_url}"\n[jobs]\nevict_grace = "{GRACE_S}s"\n'
    body = pypi_config(tmp_path / "data", upstream.base_url, extra=extra, repo_extra=repo_extra)
    body = body.replace("[storage]\n", f"[storage]\n    {storage}\n", 1)
    settings = load(write_config(tmp_path, body), {})
    async with open_engine(settings, clock) as engine:
        yield engine


def job(engine: Engine, name: str) -> Job:
    return next(j for j in engine.jobs() if j.name == name)


def add_files(upstream: FakeUpstream, count: int, size: int) -> list[ProjectFile]:
    files = [ProjectFile(f"pkg-1.{i}.tar.gz", os.urandom(size)) for i in range(count)]
    upstream.add_project("pkg", files)
    return files


def pypi_repository(engine: Engine) -> tuple[ProxyCache, PypiRepository]:
    """The pypi repository's cache view and adapter."""
    adapter = engine.adapters["pypi"]
    assert isinstance(adapter, PypiRepository)
    return engine.mirrors.sources["pypi"].cache, adapter


async def warm_in_order(engine: Engine, clock: ManualClock, files: list[ProjectFile]) -> None:
    """Fetch each file one second after the previous, so access order is file order."""
    view, adapter = pypi_repository(engine)
    for f in files:
        clock.advance(1)
        spec = adapter.file_spec("pkg", f.filename)
        assert (await view.warm(spec)).outcome == "fetched"


def blob_exists(engine: Engine, body: bytes) -> bool:
    import hashlib

    return engine.blobs.path(hashlib.sha256(body).hexdigest()).exists()


async def pass_grace(engine: Engine, clock: ManualClock) -> None:
    clock.advance(120)  # past the grace and the guard for just-published blob files
    if engine.catalog.backend == "postgres":
        await asyncio.sleep(GRACE_S + 0.2)  # tombstone ages are the database's clock


async def test_a_pass_removes_the_overshoot_least_recently_used_first(
    tmp_path: Path, upstream: FakeUpstream, clock: ManualClock, database_url: str
) -> None:
    files = add_files(upstream, 10, 100 * KB)
    storage = 'max_size = "700KB"\n    low_watermark = "80%"'
    async with engine_for(tmp_path, upstream, clock, database_url, storage) as engine:
        await warm_in_order(engine, clock, files)
        # The two oldest are read again: now the third and later are least recently used.
        view, adapter = pypi_repository(engine)
        for f in files[:2]:
            clock.advance(1)
            assert (await view.warm(adapter.file_spec("pkg", f.filename))).outcome == "cached"
        before = await engine.catalog.storage_usage()
        assert before.proxied_bytes > 1000 * KB  # ten files and the index page
        summary = await job(engine, "evict").run()
        after = await engine.catalog.storage_usage()
        # At the low watermark (560KB), short of it by less than one entry: the overshoot
        # went, not the cache.
        assert 460 * KB < after.proxied_bytes <= 560 * KB, summary
        # Least recently used first: the index page (fetched with the first file), then
        # files 2..6; the two re-read and the three newest stayed.
        present = [
            f.filename
            for f in files
            if await engine.catalog.get_entry("pypi", f"files/pkg/{f.filename}") is not None
        ]
        assert present == [files[i].filename for i in (0, 1, 7, 8, 9)]
        # Evicted blobs stay on disk through the grace period (readers finish) ...
        assert blob_exists(engine, files[2].body)
        assert after.tombstoned_bytes >= 4 * 100 * KB
        assert "nothing to evict" in await job(engine, "evict").run()  # a second pass
        await pass_grace(engine, clock)
        await job(engine, "evict").run()
        # ... and are deleted after it; what is still cached keeps its blob.
        assert not blob_exists(engine, files[2].body)
        assert blob_exists(engine, files[0].body) and blob_exists(engine, files[-1].body)
        assert (await engine.catalog.storage_usage()).tombstoned_bytes == 0
        # An evicted file is simply fetched again.
        assert (await view.warm(adapter.file_spec("pkg", files[2].filename))).outcome == "fetched"
        assert upstream.count(f"/packages/{files[2].filename}") == 2


async def test_without_max_size_nothing_is_evicted(
    tmp_path: Path, upstream: FakeUpstream, clock: ManualClock, database_url: str
) -> None:
    files = add_files(upstream, 3, 10 * KB)
    async with engine_for(tmp_path, upstream, clock, database_url) as engine:
        await warm_in_order(engine, clock, files)
        summary = await job(engine, "evict").run()
        assert "proxied" in summary and "evicted" not in summary
        assert (await engine.catalog.storage_usage()).proxied_entries == 4


async def test_retention_removes_entries_unused_for_the_repository_retention(
    tmp_path: Path, upstream: FakeUpstream, clock: ManualClock, database_url: str
) -> None:
    files = add_files(upstream, 3, 10 * KB)
    async with engine_for(
        tmp_path, upstream, clock, database_url, repo_extra='retention = "1h"'
    ) as engine:
        await warm_in_order(engine, clock, files)
        clock.advance(3000)
        view, adapter = pypi_repository(engine)
        # A hit records its access in memory only; the pass flushes it first.
        assert (await view.warm(adapter.file_spec("pkg", files[0].filename))).outcome == "cached"
        clock.advance(1000)  # files 1 and 2 (and the page) now unused for over an hour
        summary = await job(engine, "retention").run()
        assert "pypi: 3 entries" in summary
        keys = [f"files/pkg/{f.filename}" for f in files]
        assert [await engine.catalog.get_entry("pypi", k) is not None for k in keys] == [
            True,
            False,
            False,
        ]
        await pass_grace(engine, clock)
        await job(engine, "retention").run()
        assert not blob_exists(engine, files[1].body) and blob_exists(engine, files[0].body)


async def test_a_repository_without_retention_schedules_no_retention_job(
    tmp_path: Path, upstream: FakeUpstream, clock: ManualClock
) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    async with engine_for(tmp_path, upstream, clock, url) as engine:
        names = [j.name for j in engine.jobs()]
        assert names == ["reclaim", "evict", "scrub", "packages"]


def volume_bytes(engine: Engine) -> int:
    """What the blob files take on the volume (not what the catalog says)."""
    return sum(size for _sha, size, _mtime in engine.blobs.iter_blobs())


async def test_files_evicted_while_young_are_deleted_by_a_later_pass_without_reclaim(
    tmp_path: Path, upstream: FakeUpstream, clock: ManualClock, database_url: str
) -> None:
    # Issue 21: tombstones whose grace is over but whose files are younger than the
    # guard for just-published blobs were dropped with the files left on disk, until
    # reclaim's hourly orphan sweep.
    files = add_files(upstream, 10, 100 * KB)
    storage = 'max_size = "400KB"\n    low_watermark = "50%"'
    async with engine_for(tmp_path, upstream, clock, database_url, storage) as engine:
        await warm_in_order(engine, clock, files)
        assert volume_bytes(engine) >= 1000 * KB
        await job(engine, "evict").run()
        assert (await engine.catalog.storage_usage()).proxied_bytes <= 200 * KB
        # The grace is over, but the files were written moments ago (the guard).
        clock.advance(GRACE_S + 0.5)
        if engine.catalog.backend == "postgres":
            await asyncio.sleep(GRACE_S + 0.2)
        summary = await job(engine, "evict").run()
        assert "deleted 0 blobs" in summary
        assert volume_bytes(engine) >= 1000 * KB  # still there, and still tombstoned:
        assert (await engine.catalog.storage_usage()).tombstoned_bytes >= 800 * KB
        clock.advance(120)  # past the guard: the next pass deletes them, no reclaim
        summary = await job(engine, "evict").run()
        assert "deleted 0 blobs" not in summary
        assert volume_bytes(engine) <= 400 * KB
        assert (await engine.catalog.storage_usage()).tombstoned_bytes == 0
        evicted = [f for f in files if not blob_exists(engine, f.body)]
        assert len(evicted) >= 8
        for f in files:
            cached = await engine.catalog.get_entry("pypi", f"files/pkg/{f.filename}")
            assert (cached is not None) == blob_exists(engine, f.body)


async def test_blobs_older_than_the_catalog_are_not_its_orphans(
    tmp_path: Path, upstream: FakeUpstream, clock: ManualClock, database_url: str
) -> None:
    """`proxy serve` on the store of an installation with a database.url that names
    another (empty) catalog: a typo, a database restored elsewhere, an empty Postgres
    database. Every blob of the store is named by no entry there, and the reclaim job
    (run at start) deleted every one a day old within seconds."""
    import hashlib

    store = tmp_path / "data" / "blobs"
    old_bodies = [os.urandom(100) for _ in range(3)]
    three_days_ago = clock.now_ms() / 1000 - 3 * 86400
    for body in old_bodies:  # the installation's files, from before this catalog
        sha = hashlib.sha256(body).hexdigest()
        path = store / sha[:2] / sha[2:4] / sha
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        os.utime(path, (three_days_ago, three_days_ago))
    async with engine_for(tmp_path, upstream, clock, database_url) as engine:
        orphan = os.urandom(100)  # this catalog's own: a crash between publish and record
        path = engine.blobs.path(hashlib.sha256(orphan).hexdigest())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orphan)
        clock.advance(2 * 86400)
        summary = await job(engine, "reclaim").run()
        assert "1 orphan blobs" in summary, summary
        assert not blob_exists(engine, orphan)
        assert all(blob_exists(engine, body) for body in old_bodies)


async def test_the_orphan_sweep_asks_the_catalog_in_batches(
    tmp_path: Path,
    upstream: FakeUpstream,
    clock: ManualClock,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy.storage import blobs

    monkeypatch.setattr(blobs, "CANDIDATE_BATCH", 2)
    files = add_files(upstream, 2, 10 * KB)
    async with engine_for(tmp_path, upstream, clock, database_url) as engine:
        await warm_in_order(engine, clock, files)
        orphans = [os.urandom(100) for _ in range(5)]
        for body in orphans:  # files no entry names (a crash between publish and record)
            import hashlib

            path = engine.blobs.path(hashlib.sha256(body).hexdigest())
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)
        asked: list[int] = []
        unreferenced = engine.catalog.unreferenced_blobs

        async def counting(names: list[str]) -> set[str]:
            asked.append(len(names))
            return await unreferenced(names)

        monkeypatch.setattr(engine.catalog, "unreferenced_blobs", counting)
        assert "0 orphan blobs" in await job(engine, "reclaim").run()  # all too young
        clock.advance(2 * 3600)
        assert "5 orphan blobs" in await job(engine, "reclaim").run()
        assert asked == [2, 2, 2, 2]  # 8 blob files (2 files, 1 page, 5 orphans) in pairs
        assert not any(blob_exists(engine, body) for body in orphans)
        assert all(blob_exists(engine, f.body) for f in files)

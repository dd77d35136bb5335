"""Faults in the middle of the miss path and of background jobs.

The catalog here is the real SQLite backend with one operation made to fail on demand
(the database is real; only the moment of failure is chosen by the test).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from proxy.catalog import Entry, migrations_dir
from proxy.catalog.sqlite import SqliteCatalog
from proxy.clock import SYSTEM_CLOCK
from proxy.config.settings import LeaseSettings
from proxy.exceptions import CatalogError
from proxy.fetch.leases import LeaseCoordinator
from proxy.jobs import Job, Scheduler
from proxy.runtime.tasks import TaskSupervisor
from tests.upstream import FakeUpstream, ProjectFile, ServerThread

pytestmark = pytest.mark.anyio


class FlakyCatalog(SqliteCatalog):
    """SQLite, but the next call of a chosen method raises CatalogError."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, migrations_dir() / "sqlite", SYSTEM_CLOCK)
        self.fail_next: set[str] = set()

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail_next:
            self.fail_next.discard(name)
            raise CatalogError(f"injected failure of {name}")

    async def get_entry(self, repository: str, key: str) -> Entry | None:
        self._maybe_fail("get_entry")
        return await super().get_entry(repository, key)

    async def give_back_job_run(self, name: str, run_id: int) -> None:
        self._maybe_fail("give_back_job_run")
        await super().give_back_job_run(name, run_id)


async def test_a_won_lease_is_released_when_the_fetch_fails_before_the_upstream(
    tmp_path: Path,
) -> None:
    from proxy.contract import FetchSpec, OriginContext
    from proxy.fetch.fetcher import Fetcher, Miss
    from proxy.fetch.index import EntryIndex
    from proxy.storage.blobs import BlobStore
    from proxy.types import Kind

    catalog = FlakyCatalog(tmp_path / "c.db")
    await catalog.migrate()
    tasks = TaskSupervisor()
    leases = LeaseCoordinator(catalog, LeaseSettings(ttl_s=30), tasks, "me")
    blobs = BlobStore(tmp_path / "data")
    blobs.prepare()
    fetcher = Fetcher(catalog, blobs, EntryIndex(), leases, tasks, SYSTEM_CLOCK)

    class BrokenOrigin:
        def open(self, ctx: object, stale: object) -> object:
            raise CatalogError("injected: the origin needed the database, which failed")

    spec = FetchSpec("k", Kind.IMMUTABLE, BrokenOrigin())  # type: ignore[arg-type]
    context = OriginContext(upstream=None, links=None, get=None, compute=None)  # type: ignore[arg-type]
    with pytest.raises(CatalogError):
        await fetcher.fetch(Miss("r", "pypi", spec, context), stale=None)
    row = await catalog.get_lease("r/k")
    # Handed back at once (not left to expire), and not marked as the upstream's failure.
    assert row is not None and row.state == "released" and row.expired
    await tasks.close(1)
    await catalog.close()


async def test_a_cancelled_pass_ends_even_if_giving_its_claim_back_fails(tmp_path: Path) -> None:
    catalog = FlakyCatalog(tmp_path / "c.db")
    await catalog.migrate()
    tasks = TaskSupervisor()
    scheduler = Scheduler(catalog, "me", tasks, SYSTEM_CLOCK)
    started = asyncio.Event()

    async def long_pass() -> str:
        started.set()
        await asyncio.sleep(3600)
        return "never"

    scheduler.add(Job("slow", 3600, long_pass))
    scheduler.start()
    await asyncio.wait_for(started.wait(), 5)
    catalog.fail_next.add("give_back_job_run")
    await asyncio.wait_for(tasks.close(5), 10)
    assert all(t.done() for t in list(tasks._tasks)), "the job task kept running"
    await catalog.close()


@pytest.mark.parametrize("attempt", range(5))
def test_a_body_broken_off_is_an_error_status_not_an_empty_200(
    pypi_proxy: ServerThread, upstream: FakeUpstream, attempt: int
) -> None:
    f = ProjectFile("cut-1.0.tar.gz", bytes(range(256)) * 1200)
    upstream.add_project("cut", [f])
    # One chunk, then the upstream hangs up: the failure lands while that chunk's
    # write may still be in flight.
    upstream.fault(f"/packages/{f.filename}", truncate_at=100_000, chunk_size=100_000)
    httpx.get(pypi_proxy.url + "/pypi/simple/cut/")
    try:
        response = httpx.get(pypi_proxy.url + f"/pypi/files/cut/{f.filename}", timeout=30)
    except httpx.RemoteProtocolError:
        return  # streamed, then cut short: also an honest failure
    assert response.status_code in (502, 504), response.status_code

"""The job scheduler (proxy/jobs/__init__.py; docs/architecture.md, "Jobs"): one read per
check that writes nothing, a pass only under the job's lock, and runs whose pass died or
lost its lock taken up again at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import asyncpg
import pytest

import proxy.jobs
from proxy.catalog import JobRun, open_catalog
from proxy.catalog.postgres import PostgresCatalog
from proxy.clock import ManualClock
from proxy.jobs import Job, Scheduler
from proxy.runtime import metrics
from proxy.runtime.tasks import TaskSupervisor
from proxy.testing import MemoryCatalog

pytestmark = pytest.mark.anyio

CHECK_S = 0.05


@pytest.fixture(autouse=True)
def quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy.jobs, "CHECK_PERIOD_MAX_S", CHECK_S)


class CountingCatalog(MemoryCatalog):
    """The in-memory catalog, counting its operations."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.calls: Counter[str] = Counter()

    async def _enter(self, operation: str) -> None:
        self.calls[operation] += 1
        await super()._enter(operation)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def counting_job(name: str, interval_s: float, passes: Counter[str]) -> Job:
    async def run() -> str:
        passes[name] += 1
        return "done"

    return Job(name, interval_s, run)


async def test_a_check_that_finds_nothing_due_only_reads() -> None:
    clock = ManualClock()
    catalog = CountingCatalog(clock)
    tasks = TaskSupervisor()
    scheduler = Scheduler(catalog, "me", tasks, clock)
    passes: Counter[str] = Counter()
    for name in ("reclaim", "evict"):
        scheduler.add(counting_job(name, 3600, passes))
    scheduler.start()
    try:
        await until(lambda: passes == Counter(reclaim=1, evict=1), "the first passes")
        writes = {op: catalog.calls[op] for op in ("claim_job_run", "finish_job_run")}
        checks = catalog.calls["job_runs"]
        await until(lambda: catalog.calls["job_runs"] >= checks + 10, "no more checks")
        # Ten checks later: one read each, for both jobs; not a claim, not a lock.
        assert {op: catalog.calls[op] for op in writes} == writes
        assert catalog.calls["job_lock"] == 2
        clock.advance(3600)  # an interval later both are due again
        await until(lambda: passes == Counter(reclaim=2, evict=2), "the second passes")
        assert catalog.calls["claim_job_run"] == 4
    finally:
        await tasks.close(5)


async def test_a_run_left_by_a_dead_pass_runs_again_at_once() -> None:
    clock = ManualClock()
    catalog = CountingCatalog(clock)
    # A replica claimed the run and died: its lock is gone, the run still 'running'.
    async with catalog.job_lock("mirror:nightly") as got:
        assert got
        assert await catalog.claim_job_run("mirror:nightly", 3600, "dead") == 1
    tasks = TaskSupervisor()
    scheduler = Scheduler(catalog, "me", tasks, clock)
    passes: Counter[str] = Counter()
    scheduler.add(counting_job("mirror:nightly", 3600, passes))
    scheduler.start()
    try:
        # Within a check, not an interval later (the clock does not move).
        await until(lambda: passes["mirror:nightly"] == 1, "the abandoned run was left")
        runs, _now = await catalog.job_runs()
        assert [(r.run_id, r.outcome, r.holder) for r in runs] == [(2, "ok", "me")]
    finally:
        await tasks.close(5)


async def test_a_pass_is_never_run_twice_at_once_in_one_process() -> None:
    clock = ManualClock()
    catalog = CountingCatalog(clock)
    tasks = TaskSupervisor()
    scheduler = Scheduler(catalog, "me", tasks, clock)
    started = asyncio.Event()
    release = asyncio.Event()
    passes: Counter[str] = Counter()

    async def long_pass() -> str:
        passes["slow"] += 1
        started.set()
        await release.wait()
        return "done"

    scheduler.add(Job("slow", 1, long_pass))
    scheduler.start()
    try:
        await asyncio.wait_for(started.wait(), 10)
        clock.advance(10)  # due again by its interval while the pass runs
        checks = catalog.calls["job_runs"]
        await until(lambda: catalog.calls["job_runs"] >= checks + 5, "no more checks")
        assert passes["slow"] == 1
        release.set()
    finally:
        await tasks.close(5)


@pytest.mark.postgres
async def test_a_pass_whose_lock_connection_dies_gives_its_claim_back_and_runs_again(
    pg_url: str,
) -> None:
    catalog = open_catalog(pg_url)
    assert isinstance(catalog, PostgresCatalog)
    await catalog.migrate()
    tasks = TaskSupervisor()
    scheduler = Scheduler(catalog, "me", tasks, ManualClock())
    started: list[float] = []

    async def long_pass() -> str:
        started.append(time.monotonic())
        await asyncio.sleep(3600)
        return "never"

    scheduler.add(Job("mirror:nightly", 3600, long_pass))
    lost = metrics.JOB_RUNS.labels(job="mirror:nightly", outcome="lock_lost")
    before = lost._value.get()
    admin = await asyncpg.connect(pg_url)

    async def last_run() -> JobRun:
        [run] = (await catalog.job_runs())[0]
        return run

    try:
        scheduler.start()
        await until(lambda: len(started) == 1, "the first pass")
        first = await last_run()
        assert first.outcome == "running"
        assert await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'proxy-session' AND datname = current_database()"
        )
        # The pass stops, gives its claim back, and the run is taken up again (by us
        # here, by any replica in a fleet) within a check, on a new session connection.
        await until(lambda: len(started) == 2, "the run was not taken up again")
        assert lost._value.get() == before + 1
        second = await last_run()
        assert second.run_id == first.run_id + 1 and second.outcome == "running"
        assert not second.abandoned
    finally:
        await tasks.close(5)
        await admin.close()
        await catalog.close()

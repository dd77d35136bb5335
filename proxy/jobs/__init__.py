"""Background jobs that run once per fleet (docs/architecture.md, "Jobs").

Every replica runs the same ``Scheduler``. Every ``CHECK_PERIOD_MAX_S`` at most it reads
every job's last run at once (one statement, which writes nothing). A job is due if its
last start is older than its interval, or if its last run is still 'running' with
nobody holding its lock (the pass died). A due job gets a pass: it takes the job's lock
(one pass at a time for the fleet), claims the run under it (written only when it is
still due), runs, and records the outcome before letting the lock go. A pass cut off by
shutdown, or by the loss of its lock's connection, gives its claim back, so another
replica runs it at once instead of an interval later.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.catalog import Catalog, JobRun
from proxy.clock import Clock
from proxy.exceptions import CatalogError, JobLockLost
from proxy.redaction import redact
from proxy.runtime import metrics
from proxy.runtime.tasks import TaskSupervisor

if TYPE_CHECKING:
    from proxy.cache import Cache
    from proxy.config.settings import Settings
    from proxy.storage.store import Storage

log = logging.getLogger("proxy.jobs")

# How often a replica looks whether a job is due: also how soon another replica picks
# up a run given back by one that was shut down mid-run, or abandoned by one that died.
CHECK_PERIOD_MAX_S = 5.0
CHECK_JITTER_MIN = 0.8  # checks sleep between this fraction and all of the period


@dataclass(frozen=True)
class Job:
    name: str
    interval_s: float
    run: Callable[[], Awaitable[str]]  # returns a one-line summary for the log


class Scheduler:
    def __init__(self, catalog: Catalog, holder: str, tasks: TaskSupervisor, clock: Clock) -> None:
        self.catalog = catalog
        self.holder = holder
        self.tasks = tasks
        self.clock = clock
        self.jobs: list[Job] = []
        self._passes: dict[str, asyncio.Task[bool]] = {}  # this process's, by job

    def add(self, job: Job) -> None:
        self.jobs.append(job)

    def start(self) -> None:
        if self.jobs:
            self.tasks.spawn("jobs", self._loop())

    async def _loop(self) -> None:
        period_s = min(CHECK_PERIOD_MAX_S, *(job.interval_s for job in self.jobs))
        while True:
            try:
                for job in await self.due():
                    running = self._passes.get(job.name)
                    if running is None or running.done():
                        self._passes[job.name] = self.tasks.spawn(
                            f"job:{job.name}", self.run_once(job)
                        )
            except CatalogError as exc:
                _raise_if_cancelling()
                log.warning("jobs: database unavailable: %s", exc)
            await asyncio.sleep(period_s * random.uniform(CHECK_JITTER_MIN, 1.0))

    async def due(self) -> list[Job]:
        """The jobs due now, from one read of every job's last run."""
        runs, now_ms = await self.catalog.job_runs()
        last = {run.name: run for run in runs}
        return [job for job in self.jobs if _is_due(job, last.get(job.name), now_ms)]

    async def run_once(self, job: Job) -> bool:
        """Run one pass if nobody else runs it and it is still due once its lock is
        held; True if it ran."""
        try:
            async with self.catalog.job_lock(job.name) as acquired:
                if not acquired:
                    metrics.JOB_RUNS.labels(job=job.name, outcome="skipped_locked").inc()
                    return False
                run_id = await self.catalog.claim_job_run(job.name, job.interval_s, self.holder)
                if run_id is None:
                    return False  # another replica ran it since we looked
                return await self._pass(job, run_id)
        except JobLockLost as exc:
            # The pass was cancelled (and gave its claim back) when its lock went.
            metrics.JOB_RUNS.labels(job=job.name, outcome="lock_lost").inc()
            log.warning("%s; stopped the pass", exc)
            return False
        except CatalogError as exc:
            _raise_if_cancelling()
            log.warning("job %s: database unavailable: %s", job.name, exc)
            return False

    async def _pass(self, job: Job, run_id: int) -> bool:
        """The pass itself, under the job's lock."""
        try:
            summary = await job.run()
        except asyncio.CancelledError:
            metrics.JOB_RUNS.labels(job=job.name, outcome="cancelled").inc()
            try:
                await asyncio.shield(self.catalog.give_back_job_run(job.name, run_id))
            except CatalogError as exc:
                log.warning("job %s: could not give its claim back: %s", job.name, exc)
            raise
        except Exception as exc:
            metrics.JOB_RUNS.labels(job=job.name, outcome="failed").inc()
            log.error("job %s failed: %r", job.name, exc, exc_info=exc)
            await self._finish(job, run_id, "failed", f"{type(exc).__name__}: {exc}")
            return False
        # Still under the lock: the next pass cannot start before this one is recorded.
        await self._finish(job, run_id, "ok")
        metrics.JOB_RUNS.labels(job=job.name, outcome="ran").inc()
        metrics.JOB_LAST_SUCCESS.labels(job=job.name).set(self.clock.now_ms() / 1000)
        log.info("job %s: %s", job.name, summary)
        return True

    async def _finish(self, job: Job, run_id: int, outcome: str, reason: str | None = None) -> None:
        try:
            await self.catalog.finish_job_run(job.name, run_id, outcome)
            if reason is not None:  # the console lists recent failures with their reason
                await self.catalog.record_job_failure(job.name, run_id, self.holder, redact(reason))
        except CatalogError as exc:
            _raise_if_cancelling()
            log.warning("job %s: could not record its outcome %s: %s", job.name, outcome, exc)


def _is_due(job: Job, last: JobRun | None, now_ms: int) -> bool:
    if last is None or last.started_at_ms is None:
        return True
    return last.abandoned or last.started_at_ms <= now_ms - job.interval_s * 1000


def _raise_if_cancelling() -> None:
    """A database error raised while we unwind a cancellation must not swallow it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def standard_jobs(
    settings: Settings,
    catalog: Catalog,
    storage: Storage,
    cache: Cache,
    clock: Clock,
    size_limits: dict[str, int],
) -> list[Job]:
    """Reclaim, eviction (which also deletes blobs past their grace), the scrub,
    retention if a repository has one, and a sweep for every repository whose format has
    a size limit.
    """
    from proxy.jobs.evict import Eviction
    from proxy.jobs.reclaim import Reclaim
    from proxy.jobs.retention import Retention
    from proxy.jobs.scrub import JOB as SCRUB
    from proxy.jobs.scrub import Scrub
    from proxy.jobs.sweep import RepositorySweep

    intervals = settings.jobs
    reclaim = Reclaim(catalog, storage, clock, settings.leases.retention_s)
    bounds = settings.storage
    evict = Eviction(bounds.max_size, bounds.low_watermark, intervals.evict_grace_s, cache)
    scrub = Scrub(catalog, storage, cache.quarantine, bounds.scrub_rate, resume=True)
    jobs = [
        Job("reclaim", intervals.reclaim_interval_s, reclaim.run),
        Job("evict", intervals.evict_interval_s, evict.run),
        Job(SCRUB, intervals.scrub_interval_s, scrub.run),
    ]
    retentions = {r.name: r.retention_s for r in settings.repositories if r.retention_s}
    if retentions:
        retention = Retention(retentions, intervals.evict_grace_s, cache, clock)
        jobs.append(Job("retention", intervals.retention_interval_s, retention.run))
    for repository, max_size in size_limits.items():
        sweep = RepositorySweep(repository, max_size, catalog, cache)
        jobs.append(Job(f"sweep:{repository}", intervals.sweep_interval_s, sweep.run))
    return jobs

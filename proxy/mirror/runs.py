"""Mirror runs as the fleet sees them: every run (a schedule's, `proxy mirror`'s, the
admin API's) is a row of ``mirror_runs`` with its request, progress and outcome, where
`proxy jobs`, the console and ``GET /api/v1/mirror-runs/{id}`` read it
(docs/architecture.md, "Mirrors").

While a run goes, its progress is written every ``PROGRESS_INTERVAL_S``; the same
statement returns whether someone asked to cancel it (from any replica), so a
cancellation costs no statement of its own and takes effect within one interval. A run
whose progress stops being written is shown interrupted (``state_of``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from proxy.catalog import MIRROR_COUNTS, Catalog, MirrorRun
from proxy.exceptions import CatalogError
from proxy.redaction import redact

if TYPE_CHECKING:  # runner.py imports this module
    from proxy.mirror.runner import MirrorSummary, Outcome, Progress

log = logging.getLogger("proxy.mirrors")

PROGRESS_INTERVAL_S = 1.0
# A running run whose row was not written for this long has no process left to finish
# it (killed, crashed, its machine gone): its progress is written every second.
SILENT_AFTER_S = 15.0
REQUEST_PURLS_SHOWN = 200  # a run's request keeps this many of its purls (and the count)


def state_of(run: MirrorRun) -> str:
    """The run's state as shown: its row's, except that a run still 'running' whose
    progress stopped being written is 'interrupted' (whoever ran it, a replica or
    `proxy mirror`, is gone without recording an outcome)."""
    if run.state == "running" and run.now_ms - run.updated_at_ms > SILENT_AFTER_S * 1000:
        return "interrupted"
    return run.state


class RecordedProgress:
    """``Progress`` that counts for the run's row and passes everything on."""

    def __init__(self, inner: Progress | None) -> None:
        self.inner = inner
        self.counts = dict.fromkeys(MIRROR_COUNTS, 0)

    def planned(self, items: int) -> None:
        self.counts["planned"] += items
        if self.inner is not None:
            self.inner.planned(items)

    def done(self, label: str, outcome: Outcome, size: int) -> None:
        self.counts[outcome] += 1
        if outcome == "fetched":
            self.counts["bytes"] += size
        if self.inner is not None:
            self.inner.done(label, outcome, size)


def describe_request(
    purls: list[str], sbom: str | None, versions: str, repository: str | None
) -> dict[str, Any]:
    """What a run was asked to do, as its row keeps it (bounded: an SBOM may list
    thousands of purls)."""
    return {
        "purls": purls[:REQUEST_PURLS_SHOWN],
        "purl_count": len(purls),
        "sbom": sbom,
        "versions": versions,
        "repository": repository,
    }


async def run_recorded(
    catalog: Catalog,
    run_id: int,
    work: Callable[[Progress], Awaitable[MirrorSummary]],
    progress: Progress | None = None,
) -> tuple[str, MirrorSummary | None]:
    """Run ``work`` as mirror run ``run_id``: progress written as it goes, stopped when
    a cancellation is asked for, and its outcome recorded. Returns the state it ended
    in (ok, failed, cancelled) and the summary if it ran to the end. A cancellation of
    the caller (shutdown) records ``cancelled`` and is raised on."""
    recorded = RecordedProgress(progress)
    runner = asyncio.ensure_future(work(recorded))
    asked_to_cancel = False

    async def watch() -> None:
        nonlocal asked_to_cancel
        while not runner.done():
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            try:
                if await catalog.update_mirror_run(run_id, recorded.counts):
                    asked_to_cancel = True
                    runner.cancel()
                    return
            except CatalogError as exc:
                log.warning("mirror run %d: could not record its progress: %s", run_id, exc)

    watcher = asyncio.ensure_future(watch())
    summary: MirrorSummary | None = None
    state, error = "ok", None
    try:
        summary = await runner
    except asyncio.CancelledError:
        state = "cancelled"
        error = "cancelled on request" if asked_to_cancel else "the proxy stopped"
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            await _finish(catalog, run_id, state, recorded.counts, error)
            raise
    except Exception as exc:
        state, error = "failed", redact(f"{type(exc).__name__}: {exc}")
        log.error("mirror run %d failed: %s", run_id, error)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if summary is not None and (summary.failed or summary.missing or summary.skipped):
        state, error = "failed", summary.line()
    await _finish(catalog, run_id, state, recorded.counts, error)
    return state, summary


async def _finish(
    catalog: Catalog, run_id: int, state: str, counts: dict[str, int], error: str | None
) -> None:
    try:
        await asyncio.shield(catalog.finish_mirror_run(run_id, state, counts, error))
    except CatalogError as exc:
        log.warning("mirror run %d: could not record its outcome %s: %s", run_id, state, exc)

"""The app's one task group: every background task is named, held and accounted for.

Fetches and periodic jobs are started here rather than from a request, so a client
that leaves cancels only its own wait. A task that dies is logged and counted; it
never takes its siblings down (unlike a bare ``asyncio.TaskGroup``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from proxy.runtime import metrics

log = logging.getLogger("proxy.tasks")

T = TypeVar("T")


class TaskSupervisor:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    @property
    def closing(self) -> bool:
        return self._closing

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` as a named task owned by the app; returns the task for awaiting."""
        if self._closing:
            coro.close()
            raise RuntimeError("the task supervisor is closed")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            # Tasks whose result someone awaits re-raise there too; logging here makes
            # sure a failure nobody awaited is never silent.
            name = task.get_name().split(":", 1)[0]
            metrics.BACKGROUND_TASK_FAILURES.labels(task=name).inc()
            log.error("background task %s failed: %r", task.get_name(), exc, exc_info=exc)

    async def close(self, timeout_s: float) -> None:
        """Cancel every task and wait (up to ``timeout_s``) for their cleanup to finish."""
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in pending:
                log.error(
                    "background task %s did not stop within %.1fs", task.get_name(), timeout_s
                )


LAG_PROBE_INTERVAL_S = 0.1
LAG_WARNING_S = 1.0


async def watch_loop_lag() -> None:
    """Measure how late the event loop wakes a sleeper: anything running on the loop
    instead of waiting (a parse, a hash, a slow call) shows up here, and a blocked loop
    also stops lease renewals (docs/architecture.md, "The event loop only waits")."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(LAG_PROBE_INTERVAL_S)
        lag_s = max(0.0, loop.time() - started - LAG_PROBE_INTERVAL_S)
        metrics.EVENT_LOOP_LAG.observe(lag_s)
        if lag_s >= LAG_WARNING_S:
            log.warning("the event loop was blocked for %.2fs", lag_s)

"""Running blocking calls off the event loop (docs/architecture.md, "The event loop
only waits").

File I/O and hashing go to the loop's default executor, which the engine sizes for
disk work at startup (``loop.run_in_executor`` is lighter per call than anyio's thread
helper, which matters on the download path where it runs once per chunk). CPU work on
upstream input (parsing and rendering index pages) goes to a ``CpuPool`` of its own,
small so that a burst of big pages queues there instead of taking every thread, and so
that disk work never waits behind a parse.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from proxy.exceptions import UpstreamUnavailable

T = TypeVar("T")

log = logging.getLogger("proxy.blocking")

IO_THREADS = 32
CPU_THREADS = 2
CPU_PROCESSES = 1
LARGE_INPUT_BYTES = 1024 * 1024  # inputs from this size on are handled in a child process
CHILD_TASKS = 100  # a child is replaced after this many, so its memory does not linger


async def run_blocking(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def install_io_executor(loop: asyncio.AbstractEventLoop) -> ThreadPoolExecutor:
    executor = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="io")
    loop.set_default_executor(executor)
    return executor


class CpuPool:
    """Where CPU-heavy work on untrusted input runs: ``await pool.run(fn, *args)``.

    Small inputs go to a thread (cheap; the work is short). Large ones go to a child
    process: parsing or rendering a page of tens of MB spends long stretches in C code
    that holds the interpreter lock (``json.loads``, ``json.dumps``) and creates millions
    of objects whose garbage collection would hold it too, and in a thread both stall
    the event loop for hundreds of milliseconds. The child also keeps that memory out of
    the server process. ``fn`` and its arguments must be picklable (module-level).

    A child that dies (killed, out of memory) is replaced: the work it was doing fails
    with a 503 (retry), the next work gets a new child.
    """

    def __init__(self, threads: int = CPU_THREADS, processes: int = CPU_PROCESSES) -> None:
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cpu")
        self._children = [_Child() for _ in range(processes)]
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        for child in self._children:
            self._idle.put_nowait(child)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        size = sum(len(a) for a in args if isinstance(a, bytes | str))
        if size < LARGE_INPUT_BYTES:
            return await loop.run_in_executor(self._threads, fn, *args)
        child = await self._idle.get()
        try:
            return await child.run(fn, args)
        finally:
            self._idle.put_nowait(child)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for child in self._children:
            child.stop()


class _Child:
    """One child process (a one-worker ``ProcessPoolExecutor``), started when first
    needed and given one piece of work at a time."""

    def __init__(self) -> None:
        self._executor: ProcessPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        loop = asyncio.get_running_loop()
        if self._executor is not None and not self._alive(self._executor):
            # It died while idle (killed, out of memory): nothing was lost, start anew.
            log.warning("the page parser process had died; starting a new one")
            self.stop()
        try:
            future = loop.run_in_executor(self._start(), fn, *args)
        except BrokenProcessPool:  # it died just now, and the executor noticed first
            self.stop()
            future = loop.run_in_executor(self._start(), fn, *args)
        try:
            return await future
        except BrokenProcessPool:
            log.error("the page parser process died while parsing; starting a new one")
            self.stop()
            raise UpstreamUnavailable(
                "the page parser restarted (its process died while parsing this page); retry",
                status=503,
            ) from None

    def _start(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_child_init,
                max_tasks_per_child=CHILD_TASKS,
            )
        return self._executor

    @staticmethod
    def _alive(executor: ProcessPoolExecutor) -> bool:
        return all(p.is_alive() for p in list((executor._processes or {}).values()))

    def stop(self) -> None:
        """End the child at once, whatever it is doing (it works on our input only)."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        # No public way to stop a busy worker before Python 3.14 (kill_workers).
        for process in list((executor._processes or {}).values()):
            process.kill()
        executor.shutdown(wait=False, cancel_futures=True)


def _child_init() -> None:
    # The child's metrics are never exported: keep them in memory, out of the shared
    # multiprocess folder (read before proxy.metrics is first imported here).
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us, not a Ctrl+C

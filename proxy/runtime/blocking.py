"""Running blocking calls off the event loop (docs/architecture.md, "The event loop
only waits").

File I/O and hashing go to the loop's default executor, which the engine sizes for
disk work at startup (``loop.run_in_executor`` is lighter per call than anyio's thread
helper, which matters on the download path where it runs once per chunk). CPU work on
upstream input (parsing and rendering index pages) goes to a ``CpuPool`` of its own:
a few child processes that can be stopped when a parse runs too long, and two threads
for inputs too small to take long, so that disk work never waits behind a parse.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from proxy.exceptions import ParseFailed, RetryLater
from proxy.units import format_duration

T = TypeVar("T")

log = logging.getLogger("proxy.blocking")

IO_THREADS = 32
CPU_THREADS = 2
CPU_PROCESSES = 2
# Inputs up to this size are handled in a thread, larger ones in a child process. A
# thread cannot be stopped, so only what is quick whatever it holds goes there: CPython's
# HTMLParser is quadratic on some inputs ("<a " repeated: 8 KiB take ~0.3 s, 120 KB
# minutes), and JSON pages are parsed, rendered and recorded in one go.
THREAD_INPUT_MAX_BYTES = 8 * 1024
# After work on an input this large, the memory its transfer to and from the child freed
# is handed back to the system (``trim_heap``).
TRIM_AFTER_BYTES = 4 * 2**20
CHILD_TASKS = 100  # a child is replaced after this many, so its memory does not linger
DEFAULT_DEADLINE_S = 30.0  # upstream.parse_timeout


async def run_blocking(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def install_io_executor(loop: asyncio.AbstractEventLoop) -> ThreadPoolExecutor:
    executor = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="io")
    loop.set_default_executor(executor)
    return executor


class CpuPool:
    """Where CPU-heavy work on untrusted input runs: ``await pool.run(fn, *args)``.

    Tiny inputs go to a thread (cheap; the work is short whatever the input). Others go
    to a child process, one piece of work per child at a time, with a deadline
    (``upstream.parse_timeout``): a child still at work then is killed, and the work
    fails with a 502. In a thread that work could be neither bounded nor stopped (a
    stuck thread also holds the process at exit). A child also helps big pages: parsing
    or rendering tens of MB spends long stretches in C code that holds the interpreter
    lock (``json.loads``, ``json.dumps``) and creates millions of objects whose garbage
    collection would hold it too, stalling the event loop; and the child's memory is not
    the server's. ``fn`` and its arguments must be picklable (module-level).

    A child that dies (killed, out of memory) is replaced: the work it was doing fails
    with a 503 (retry), the next work gets a new child.
    """

    def __init__(
        self,
        deadline_s: float = DEFAULT_DEADLINE_S,
        threads: int = CPU_THREADS,
        processes: int = CPU_PROCESSES,
    ) -> None:
        self.deadline_s = deadline_s
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cpu")
        self._children = [_Child() for _ in range(processes)]
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        for child in self._children:
            self._idle.put_nowait(child)

    async def run(self, fn: Callable[..., T], *args: object, weight: int | None = None) -> T:
        """``fn(*args)`` in a thread or a child, by the size of its input: the bytes and
        text among ``args``, or ``weight`` when the input is elsewhere (a file ``fn``
        reads itself, so it need not be copied to the child)."""
        loop = asyncio.get_running_loop()
        size = (
            weight
            if weight is not None
            else sum(len(a) for a in args if isinstance(a, bytes | str))
        )
        if size <= THREAD_INPUT_MAX_BYTES:
            return await loop.run_in_executor(self._threads, fn, *args)
        try:
            async with asyncio.timeout(self.deadline_s):
                child = await self._idle.get()
        except TimeoutError:
            raise RetryLater(
                f"all {len(self._children)} page parsers stayed busy for "
                f"{format_duration(self.deadline_s)}; retry"
            ) from None
        try:
            return await child.run(fn, args, self.deadline_s)
        finally:
            self._idle.put_nowait(child)
            if size >= TRIM_AFTER_BYTES:
                await loop.run_in_executor(self._threads, trim_heap)

    def close(self) -> None:
        """Stop at once: children are killed whatever they are doing; a thread is never
        busy for long (``THREAD_INPUT_MAX_BYTES``)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        for child in self._children:
            child.stop()


class _Child:
    """One child process (a one-worker ``ProcessPoolExecutor``), started when first
    needed and given one piece of work at a time."""

    def __init__(self) -> None:
        self._executor: ProcessPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], args: tuple[Any, ...], deadline_s: float) -> T:
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
            async with asyncio.timeout(deadline_s):
                return await future
        except TimeoutError:
            log.warning(
                "a page parse ran past upstream.parse_timeout (%s); its process was stopped",
                format_duration(deadline_s),
            )
            self.stop()
            raise ParseFailed(
                "the upstream page took too long to parse (over upstream.parse_timeout, "
                f"{format_duration(deadline_s)}); its parser was stopped"
            ) from None
        except asyncio.CancelledError:
            self.stop()  # nobody waits for the result: do not let it run on
            raise
        except BrokenProcessPool:
            log.error("the page parser process died while parsing; starting a new one")
            self.stop()
            raise RetryLater(
                "the page parser restarted (its process died while parsing this page); retry"
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


def _libc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to trim
    return trim


_MALLOC_TRIM = _libc_trim()


def trim_heap() -> None:
    """Give memory freed in the C heap back to the system (glibc's ``malloc_trim``).
    A page of tens of MB crosses to and from a child as pickles, which glibc leaves in
    the arenas of the threads that made them: without this, the server's resident size
    stays at its highest for good, however little it holds."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _child_init() -> None:
    # The child's metrics are never exported: keep them in memory, out of the shared
    # multiprocess folder (read before proxy.runtime.metrics is first imported here).
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us, not a Ctrl+C

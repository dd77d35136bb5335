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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

IO_THREADS = 32
CPU_THREADS = 2


async def run_blocking(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def install_io_executor(loop: asyncio.AbstractEventLoop) -> ThreadPoolExecutor:
    executor = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="io")
    loop.set_default_executor(executor)
    return executor


class CpuPool:
    """Threads for CPU-heavy work on untrusted input; ``await pool.run(fn, *args)``."""

    def __init__(self, threads: int = CPU_THREADS) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cpu")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""Running blocking calls (file I/O, hashing) off the event loop.

``loop.run_in_executor`` on the loop's default executor, which the app sizes for disk
work at startup: lighter per call than anyio's thread helper, which matters on the
download path where it runs once per chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

IO_THREADS = 32


async def run_blocking(fn: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def install_io_executor(loop: asyncio.AbstractEventLoop) -> ThreadPoolExecutor:
    executor = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="io")
    loop.set_default_executor(executor)
    return executor

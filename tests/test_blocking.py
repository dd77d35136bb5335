"""The CpuPool (proxy/runtime/blocking.py): where parsing of upstream input runs. Real threads
and real child processes; the functions they run are module-level (picklable)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from proxy.exceptions import ParseFailed, RetryLater
from proxy.http.errors import rule_for
from proxy.runtime.blocking import THREAD_INPUT_MAX_BYTES, CpuPool

pytestmark = pytest.mark.anyio

BIG = b"x" * (THREAD_INPUT_MAX_BYTES + 1)  # goes to a child process


def pid_of(_payload: bytes) -> int:
    return os.getpid()


def nap(_payload: bytes) -> int:
    time.sleep(120)  # a parse that would hold a thread (and the process's exit) this long
    return 0


def die(_payload: bytes) -> int:
    os.kill(os.getpid(), signal.SIGKILL)
    return 0


def gone(pid: int) -> bool:
    """Has process ``pid`` ended (exited, or a zombie waiting to be reaped)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        # the entry vanishes when the process is reaped: between open and read the
        # read fails with ESRCH instead of the open failing with ENOENT
        return True
    return "\nState:\tZ" in status


async def wait_until_gone(pid: int) -> None:
    for _ in range(200):
        if gone(pid):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"process {pid} is still running")


async def test_only_inputs_of_a_few_kib_run_in_a_thread() -> None:
    pool = CpuPool()
    try:
        assert await pool.run(pid_of, b"x" * THREAD_INPUT_MAX_BYTES) == os.getpid()
        assert await pool.run(pid_of, BIG) != os.getpid()
        assert await pool.run(pid_of, b"<a " * 40_000) != os.getpid()  # 120 KB: minutes
    finally:
        pool.close()


async def test_work_past_the_deadline_is_a_502_and_its_child_is_stopped() -> None:
    pool = CpuPool(deadline_s=1.0, processes=1)
    try:
        child = await pool.run(pid_of, BIG)
        with pytest.raises(ParseFailed, match="took too long to parse") as raised:
            await pool.run(nap, BIG)
        assert rule_for(raised.value).status == 502
        await wait_until_gone(child)
        assert await pool.run(pid_of, BIG) not in (child, os.getpid())
    finally:
        pool.close()


async def test_cancelled_work_stops_its_child() -> None:
    pool = CpuPool(processes=1)
    try:
        child = await pool.run(pid_of, BIG)
        busy = asyncio.create_task(pool.run(nap, BIG))
        await asyncio.sleep(0.2)  # handed to the child
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        await wait_until_gone(child)
    finally:
        pool.close()


async def test_close_stops_busy_children_at_once() -> None:
    pool = CpuPool(processes=2)
    children = {await pool.run(pid_of, BIG), await pool.run(pid_of, BIG)}
    busy = [asyncio.create_task(pool.run(nap, BIG)) for _ in children]
    await asyncio.sleep(0.2)  # both are handed to their children
    pool.close()
    for pid in children:
        await wait_until_gone(pid)
    for task in busy:
        task.cancel()
    await asyncio.gather(*busy, return_exceptions=True)


async def test_a_child_that_dies_while_parsing_is_a_503_and_is_replaced() -> None:
    pool = CpuPool()
    try:
        with pytest.raises(RetryLater, match="restarted") as raised:
            await pool.run(die, BIG)
        assert rule_for(raised.value).status == 503
        assert await pool.run(pid_of, BIG) != os.getpid()
    finally:
        pool.close()


async def test_a_child_that_died_while_idle_is_replaced_unnoticed() -> None:
    pool = CpuPool()
    try:
        first = await pool.run(pid_of, BIG)
        os.kill(first, signal.SIGKILL)  # the OOM killer, between two pages
        await wait_until_gone(first)
        second = await pool.run(pid_of, BIG)
        assert second not in (first, os.getpid())
    finally:
        pool.close()

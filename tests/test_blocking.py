"""The CpuPool (proxy/blocking.py): where parsing of upstream input runs. Real threads
and real child processes; the functions they run are module-level (picklable)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from proxy.blocking import LARGE_INPUT_BYTES, CpuPool
from proxy.exceptions import UpstreamUnavailable

pytestmark = pytest.mark.anyio

BIG = b"x" * LARGE_INPUT_BYTES  # goes to a child process


def pid_of(_payload: bytes) -> int:
    return os.getpid()


def die(_payload: bytes) -> int:
    os.kill(os.getpid(), signal.SIGKILL)
    return 0


def gone(pid: int) -> bool:
    """Has process ``pid`` ended (exited, or a zombie waiting to be reaped)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


async def wait_until_gone(pid: int) -> None:
    for _ in range(200):
        if gone(pid):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"process {pid} is still running")


async def test_small_inputs_run_in_a_thread_large_ones_in_a_child() -> None:
    pool = CpuPool()
    try:
        assert await pool.run(pid_of, b"small") == os.getpid()
        assert await pool.run(pid_of, BIG) != os.getpid()
    finally:
        pool.close()


async def test_a_child_that_dies_while_parsing_is_a_503_and_is_replaced() -> None:
    pool = CpuPool()
    try:
        with pytest.raises(UpstreamUnavailable, match="restarted") as raised:
            await pool.run(die, BIG)
        assert raised.value.status == 503
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

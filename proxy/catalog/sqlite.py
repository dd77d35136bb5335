"""The embedded catalog: one SQLite file (WAL), one connection per process.

Every statement runs on one dedicated thread, so the event loop never waits on the
disk and statements of one process never interleave; nothing that belongs to that
thread (a cursor, a statement) ever leaves it. Several processes (``--workers``) share
the file; SQLite's write lock serializes their transactions, which is what makes the
lease claim atomic here. Times are Unix milliseconds from the catalog's clock, which
SQL reads as ``clock_ms()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from proxy.catalog import JobRun, LeaseRow, migration_files
from proxy.catalog.base import SqlCatalog
from proxy.catalog.queries import load
from proxy.clock import Clock
from proxy.exceptions import CatalogError
from proxy.runtime.blocking import run_blocking

T = TypeVar("T")
log = logging.getLogger("proxy.catalog")

BUSY_TIMEOUT_MS = 15_000
WAL_SWITCH_RETRY_S = 0.05  # switching a new file to WAL can fail "locked" without waiting


class SqliteCatalog(SqlCatalog):
    backend = "sqlite"
    queries = load("sqlite")
    CLAIM_PRELUDE = ("next_fence", "trim_fences")

    def __init__(self, path: Path, migrations: Path, clock: Clock) -> None:
        super().__init__(clock)
        self.path = path
        self.migrations = migrations
        self.locks_dir = path.parent / f"{path.name}.locks"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")
        self._conn: sqlite3.Connection | None = None

    # -- plumbing -------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=BUSY_TIMEOUT_MS / 1000,
            )
            try:
                conn.row_factory = sqlite3.Row  # rows are read by column name
                conn.create_function("clock_ms", 0, self.clock.now_ms)
                _switch_to_wal(conn)
                # FULL: an acknowledged build-cache PUT must survive a power cut.
                conn.execute("PRAGMA synchronous = FULL")
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            try:
                return fn(self._connect())
            except sqlite3.Error as exc:
                raise CatalogError(f"sqlite {self.path}: {exc}") from exc

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def _fetchrow(self, name: str, *args: Any) -> Any:
        sql = self.queries[name]
        return await self._run(lambda conn: conn.execute(sql, args).fetchone())

    async def _fetch(self, name: str, *args: Any) -> list[Any]:
        sql = self.queries[name]
        return await self._run(lambda conn: conn.execute(sql, args).fetchall())

    async def _execute(self, name: str, *args: Any) -> int:
        sql = self.queries[name]
        return await self._run(_in_transaction(lambda conn: conn.execute(sql, args).rowcount))

    async def _write_returning(self, name: str, *args: Any, prelude: tuple[str, ...] = ()) -> Any:
        statements = [self.queries[p] for p in prelude]
        sql = self.queries[name]

        def write(conn: sqlite3.Connection) -> Any:
            for statement in statements:
                conn.execute(statement)
            rows = conn.execute(sql, args).fetchall()  # all: COMMIT needs it finished
            return rows[0] if rows else None

        return await self._run(_in_transaction(write))

    async def _write_fetch(self, name: str, *args: Any) -> list[Any]:
        sql = self.queries[name]
        return await self._run(_in_transaction(lambda conn: conn.execute(sql, args).fetchall()))

    async def migrate(self) -> list[str]:
        files = migration_files(self.migrations)
        q = self.queries

        def apply(conn: sqlite3.Connection) -> list[str]:
            conn.execute(q["create_schema_migrations"])
            done = {row["version"] for row in conn.execute(q["applied_migrations"])}
            applied = []
            for version, name, sql in files:
                if version in done:
                    continue
                for statement in _split_sql(sql):
                    conn.execute(statement)
                conn.execute(q["record_migration"], (version, name))
                applied.append(name)
            return applied

        # EXCLUSIVE: workers started together apply the schema once, one after another.
        return await self._run(_in_transaction(apply, "BEGIN EXCLUSIVE"))

    async def close(self) -> None:
        def close(conn: sqlite3.Connection) -> None:
            conn.close()
            self._conn = None

        if self._conn is not None:
            await self._run(close)
        self._executor.shutdown(wait=True)

    # -- jobs ------------------------------------------------------------------------

    @asynccontextmanager
    async def job_lock(self, name: str) -> AsyncIterator[bool]:
        # An flock, not a row: like Postgres' session lock it is gone the moment the
        # holder's process dies, however it dies. SQLite lives on one machine, so a
        # lock file beside it reaches every process that can open the database.
        fd = await run_blocking(self._try_lock, self.locks_dir / _lock_file_name(name))
        try:
            yield fd is not None
        finally:
            if fd is not None:
                await run_blocking(_unlock, fd)

    async def job_runs(self) -> tuple[list[JobRun], int]:
        """As in ``SqlCatalog``, and a run still 'running' is abandoned if nobody holds
        its job's flock: only a process can tell (it tries the lock for a moment)."""
        runs, now_ms = await super().job_runs()
        running = [run.name for run in runs if run.outcome == "running"]
        if not running:
            return runs, now_ms
        held = await run_blocking(lambda: {name for name in running if self._lock_held(name)})
        return [
            replace(run, abandoned=run.outcome == "running" and run.name not in held)
            for run in runs
        ], now_ms

    def _lock_held(self, name: str) -> bool:
        fd = self._try_lock(self.locks_dir / _lock_file_name(name))
        if fd is None:
            return True
        _unlock(fd)
        return False

    def _try_lock(self, path: Path) -> int | None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CatalogError(f"job lock {path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            os.close(fd)
            raise CatalogError(f"job lock {path}: {exc}") from exc
        return fd

    async def listen_leases(
        self,
        on_notify: Callable[[str, LeaseRow | None], None],
        on_listening: Callable[[bool], None] | None = None,
    ) -> None:
        # SQLite has no notifications: waiters poll. Stay parked until cancelled.
        await asyncio.Event().wait()


def _in_transaction(
    fn: Callable[[sqlite3.Connection], T], begin: str = "BEGIN IMMEDIATE"
) -> Callable[[sqlite3.Connection], T]:
    """``fn`` in one transaction; IMMEDIATE takes the write lock up front (no upgrade
    deadlocks between processes)."""

    def tx(conn: sqlite3.Connection) -> T:
        conn.execute(begin)
        try:
            result = fn(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return result

    return tx


def _switch_to_wal(conn: sqlite3.Connection) -> None:
    """``PRAGMA journal_mode = WAL``, retried: on a brand-new file several processes race
    to switch it, and the loser gets "database is locked" at once (the busy timeout does
    not apply to this pragma)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(WAL_SWITCH_RETRY_S)


def _lock_file_name(job: str) -> str:
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", job)[:64]
    return f"{readable}-{hashlib.sha256(job.encode()).hexdigest()[:12]}.lock"


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _split_sql(sql: str) -> list[str]:
    """Statements of a migration file; a trigger's body (with its own semicolons) stays
    whole, because a statement ends only where SQLite says it is complete."""
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    statements: list[str] = []
    current = ""
    for line in lines:
        current += line + "\n"
        if sqlite3.complete_statement(current):
            statements.append(current.strip().rstrip(";"))
            current = ""
    if current.strip():
        statements.append(current.strip())
    return [stmt for stmt in statements if stmt]

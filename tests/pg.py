"""A real PostgreSQL server for tests, started with initdb/pg_ctl into a temp folder.

As root the binaries run through ``runuser -u postgres``. Tests can stop and restart
the server to inject faults. ``PROXY_TEST_POSTGRES_URL`` points the shared fixture at
an existing server instead; tests that stop the server always start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import asyncpg

PG_BIN_CANDIDATES = (
    "/usr/lib/postgresql/17/bin",
    "/usr/lib/postgresql/16/bin",
    "/usr/lib/postgresql/15/bin",
)


def find_pg_binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for folder in PG_BIN_CANDIDATES:
        candidate = Path(folder) / name
        if candidate.exists():
            return str(candidate)
    raise RuntimeError(
        f"PostgreSQL's {name} is not installed: install the postgresql package "
        "(.ci/run does) or set PROXY_TEST_POSTGRES_URL"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    def __init__(self, settings: dict[str, str] | None = None) -> None:
        """``settings``: extra server settings (``-c name=value``), e.g. a preloaded
        extension for a benchmark."""
        self.settings = dict(settings or {})
        self.base = Path(tempfile.mkdtemp(prefix="proxy-test-pg-"))
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self.port = free_port()
        self.as_postgres = os.geteuid() == 0
        os.chmod(self.base, 0o777)

    def _run(self, *command: str) -> None:
        argv = list(command)
        if self.as_postgres:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(
                f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}\n{log}"
            )

    def init(self) -> PostgresServer:
        self._run(
            find_pg_binary("initdb"), "-D", str(self.data), "-U", "postgres",
            "--auth=trust", "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        return self

    def start(self) -> PostgresServer:
        options = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=300"
        )
        for name, value in self.settings.items():
            options += f" -c {name}={value}"
        self._run(
            find_pg_binary("pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.log), "-w", "-t", "60", "start",
        )  # fmt: skip
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run(find_pg_binary("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"


def create_database(admin_url: str) -> str:
    """A fresh empty database on the server; returns its URL."""
    name = f"t_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    base, _, _ = admin_url.rpartition("/")
    return f"{base}/{name}"


def drop_database(url: str) -> None:
    base, _, name = url.rpartition("/")

    async def drop() -> None:
        conn = await asyncpg.connect(f"{base}/postgres")
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(drop())

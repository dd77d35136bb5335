"""A real PgBouncer (Debian's ``pgbouncer`` package) in front of a test Postgres server.

Transaction pooling by default, with fewer server connections than the fleet has
clients, which is how a large fleet runs it (README, "Running a large fleet"). As root
it runs as the ``postgres`` user: PgBouncer refuses to run as root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tests.pg import free_port

START_TIMEOUT_S = 30.0


def find_pgbouncer() -> str:
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/sbin")
    if found is None:
        raise RuntimeError(
            "PgBouncer is not installed: install the pgbouncer package (.ci/run does)"
        )
    return found


class PgBouncer:
    def __init__(
        self, postgres_port: int, pool_mode: str = "transaction", pool_size: int = 4
    ) -> None:
        self.postgres_port = postgres_port
        # Its own folder, open to the user it runs as (a test's tmp_path is not).
        self.folder = Path(tempfile.mkdtemp(prefix="proxy-test-pgbouncer-"))
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.port = free_port()
        self.log_path = self.folder / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> PgBouncer:
        os.chmod(self.folder, 0o777)
        users = self.folder / "users.txt"
        users.write_text('"postgres" ""\n')
        config = self.folder / "pgbouncer.ini"
        config.write_text(f"""
[databases]
* = host=127.0.0.1 port={self.postgres_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {users}
pool_mode = {self.pool_mode}
default_pool_size = {self.pool_size}
max_client_conn = 1000
; After a failed login (Postgres restarting), try again within a second, not after
; the default 15 s, during which every client is refused (README, "Running a large
; fleet").
server_login_retry = 1
logfile = {self.log_path}
""")
        user = "postgres" if os.geteuid() == 0 else None
        with (self.folder / "output.log").open("ab") as output:
            self.process = subprocess.Popen(
                [find_pgbouncer(), str(config)],
                stdout=output,
                stderr=subprocess.STDOUT,
                user=user,
                group=user,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"pgbouncer exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen within {START_TIMEOUT_S}s:\n{self.log()}")

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)

    def log(self) -> str:
        paths = (self.folder / "output.log", self.log_path)
        return "".join(p.read_text(errors="replace") for p in paths if p.exists())


@dataclass(frozen=True)
class FleetDb:
    """Where a fleet's replicas connect: straight to Postgres, or their pool through a
    real PgBouncer in transaction mode with their session connections straight to
    Postgres (``session_url``). ``direct`` is the test's own way in."""

    url: str
    direct: str
    session_url: str | None = None

    @property
    def route(self) -> str:
        return "direct" if self.url == self.direct else "pgbouncer"


def behind(route: str, direct_url: str) -> tuple[FleetDb, PgBouncer | None]:
    """The database ``direct_url`` as a fleet reaches it: ``route`` "direct", or
    "pgbouncer" (a new PgBouncer in front of its server, which the caller stops)."""
    if route == "direct":
        return FleetDb(direct_url, direct_url), None
    parts = urlsplit(direct_url)
    assert parts.port is not None, direct_url
    bouncer = PgBouncer(parts.port).start()
    pooled = bouncer.url(parts.path.lstrip("/"))
    return FleetDb(pooled, direct_url, session_url=direct_url), bouncer

"""The one session connection of a replica to Postgres (docs/architecture.md, "The
catalog's connections").

Whatever needs a session runs here and nowhere else: LISTEN for lease notifications
and the session advisory locks that job passes hold. So the pool may go through a
transaction-mode pooler (PgBouncer), and a pooled connection needs no reset when it is
handed back. The connection is made when first needed and made again after a drop (a
restart, a failover, a terminated backend): its channels are listened to again, and
whoever held a lock on the lost connection is told at once, since the server released
the lock with it. TCP keepalives find a server that vanished without closing the
connection (a failover whose old primary is unreachable) within
``KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES`` seconds, without a
statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg

from proxy.exceptions import CatalogError
from proxy.runtime import metrics

log = logging.getLogger("proxy.catalog")

KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3
# Data sent but not acknowledged for this long also means the server is gone.
USER_TIMEOUT_MS = (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES) * 1000
# Reconnecting: the wait doubles from RETRY_MIN_S up to RETRY_MAX_S, jittered down to
# half, so a fleet whose database comes back does not reconnect in one burst, and a
# replica is back well within a lease TTL of the database.
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0

# InternalClientError: a connection left in a broken state by a server restart
# ("cannot switch to state 12; another operation is in progress").
DRIVER_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)


@contextmanager
def translated(operation: str) -> Iterator[None]:
    """asyncpg's errors as ``CatalogError``, naming the operation."""
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise CatalogError(f"postgres {operation}: {type(exc).__name__}: {exc}") from exc


class SessionConnection:
    """A connection that reconnects by itself and tells its users when it was lost."""

    def __init__(
        self, dsn: str, application_name: str, connect_timeout_s: float, command_timeout_s: float
    ) -> None:
        self.dsn = dsn
        self.application_name = application_name
        self.connect_timeout_s = connect_timeout_s
        self.command_timeout_s = command_timeout_s
        self._conn: asyncpg.Connection | None = None
        self._lost = asyncio.Event()
        self._lost.set()  # no connection yet
        self._lost_at: float | None = None  # when the last connection was lost (monotonic)
        self._connecting = asyncio.Lock()
        self._statements = asyncio.Lock()  # one statement at a time on one connection
        self._channels: dict[str, Callable[[str], None]] = {}
        self._watchers: list[Callable[[bool], None]] = []
        self._on_loss: dict[int, Callable[[], None]] = {}
        self._next_handle = 0
        self._closed = False

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    def watch(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(True)`` whenever the connection (with its channels) is up,
        ``callback(False)`` whenever it is lost."""
        self._watchers.append(callback)
        if self.connected:
            callback(True)

    async def listen(self, channel: str, callback: Callable[[str], None]) -> None:
        """LISTEN on ``channel`` now if connected, and on every connection from now on."""
        self._channels[channel] = callback
        if self.connected:
            async with self._statements:
                conn = await self.connection()
                with translated("listen"):
                    await conn.add_listener(channel, _deliver(callback))

    def on_loss(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once, when the current connection is lost; returns a function
        that cancels this."""
        handle = self._next_handle
        self._next_handle += 1
        self._on_loss[handle] = callback

        def cancel() -> None:
            self._on_loss.pop(handle, None)

        return cancel

    async def fetchval(self, operation: str, sql: str, *args: Any) -> Any:
        """Run one statement on the session (connecting first if needed)."""
        async with self._statements:
            conn = await self.connection()
            with translated(operation):
                return await conn.fetchval(sql, *args, timeout=self.command_timeout_s)

    async def connection(self) -> asyncpg.Connection:
        """The live connection, made (again) if there is none."""
        if self._closed:
            raise CatalogError("postgres: the catalog is closed")
        async with self._connecting:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            with translated("session connect"):
                conn = await asyncpg.connect(
                    self.dsn,
                    timeout=self.connect_timeout_s,
                    statement_cache_size=0,
                    server_settings={"application_name": self.application_name},
                )
            try:
                _keep_alive(conn)
                with translated("listen"):
                    for channel, callback in self._channels.items():
                        await conn.add_listener(channel, _deliver(callback))
            except BaseException:
                conn.terminate()
                raise
            conn.add_termination_listener(self._terminated)
            self._conn = conn
            self._lost = asyncio.Event()
            if self._lost_at is not None:
                metrics.DATABASE_RECONNECTS.labels(connection="session").inc()
                log.info(
                    "database session connection back after %.1fs",
                    asyncio.get_running_loop().time() - self._lost_at,
                )
                self._lost_at = None
            for watcher in self._watchers:
                watcher(True)
            return conn

    async def keep_open(self) -> None:
        """Until cancelled: connect, wait for a loss, connect again (with backoff)."""
        delay_s = RETRY_MIN_S
        while True:
            try:
                await self.connection()
            except CatalogError as exc:
                wait_s = delay_s * random.uniform(0.5, 1.0)
                log.warning(
                    "database session connection unavailable (%s); retrying in %.1fs",
                    exc,
                    wait_s,
                )
                await asyncio.sleep(wait_s)
                delay_s = min(delay_s * 2, RETRY_MAX_S)
                continue
            delay_s = RETRY_MIN_S
            await self._lost.wait()
            await asyncio.sleep(RETRY_MIN_S)

    def _terminated(self, conn: asyncpg.Connection) -> None:
        if conn is not self._conn:
            return
        self._conn = None
        self._lost.set()
        if self._closed:
            return
        self._lost_at = asyncio.get_running_loop().time()
        log.warning(
            "database session connection lost; job locks on it are gone, lease waiters "
            "poll until it is back"
        )
        handlers = list(self._on_loss.values())
        self._on_loss.clear()
        for watcher in self._watchers:
            watcher(False)
        for handler in handlers:
            handler()

    async def close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        self._lost.set()
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), timeout=5)
            except (TimeoutError, *DRIVER_ERRORS):
                conn.terminate()


def _deliver(callback: Callable[[str], None]) -> Callable[..., None]:
    def on_notification(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        callback(payload)

    return on_notification


def _keep_alive(conn: asyncpg.Connection) -> None:
    """TCP keepalives on the connection's socket, where the platform has them."""
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # a Unix socket: the peer is on this machine
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
            ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
        ):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)

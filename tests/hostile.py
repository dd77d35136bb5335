"""Fault injection with raw sockets: an upstream that answers byte by byte as a test
scripts it, and clients that misbehave (slowloris, never reading).

A real HTTP server (uvicorn, as in tests/upstream.py) refuses to send what a hostile
upstream sends: header values with raw UTF-8, a body longer or shorter than its
Content-Length, a head that trickles in. This one writes exactly the bytes it is
given. Every behaviour ends by itself (no behaviour waits forever): hangs are bounded
by ``HANG_S`` and the server's stop.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

HANG_S = 120.0

Behaviour = Callable[[asyncio.StreamWriter, "Request"], Awaitable[None]]


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class HostileUpstream:
    routes: dict[str, Behaviour] = field(default_factory=dict)
    requests: Counter[str] = field(default_factory=Counter)
    seen: list[Request] = field(default_factory=list)
    base_url: str = ""
    port: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._stopped = asyncio.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> HostileUpstream:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("hostile upstream did not start")
        self.base_url = f"http://127.0.0.1:{self.port}"
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stopped.wait()
            server.close()
            handlers = asyncio.all_tasks() - {asyncio.current_task()}
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            await asyncio.sleep(0.05)  # let closing transports finish closing

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_S)
                except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _version = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                path = target.split("?", 1)[0]
                request = Request(method, path, headers)
                self.requests[path] += 1
                self.seen.append(request)
                behaviour = self.routes.get(path, not_found)
                await behaviour(writer, request)
                if writer.is_closing():
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()


def head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [b"HTTP/1.1 %d X" % status]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


# -- behaviours ---------------------------------------------------------------------------


async def not_found(writer: asyncio.StreamWriter, request: Request) -> None:
    writer.write(head(404, [(b"content-length", b"10")]) + b"not found\n")
    await writer.drain()


def ok(
    body: bytes,
    content_type: bytes = b"application/octet-stream",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> Behaviour:
    async def send(writer: asyncio.StreamWriter, request: Request) -> None:
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        writer.write(head(200, headers + (extra or [])))
        if request.method != "HEAD":
            writer.write(body)
        await writer.drain()

    return send


def raw(data: bytes, then_close: bool = True) -> Behaviour:
    """Exactly these bytes (head and body, true or not), then hang up."""

    async def send(writer: asyncio.StreamWriter, request: Request) -> None:
        writer.write(data)
        await writer.drain()
        if then_close:
            writer.close()

    return send


def trickle(body: bytes, every_s: float, announce_length: bool = True) -> Behaviour:
    """A body sent one byte every ``every_s`` seconds (an upstream that never stalls long
    enough for a read timeout)."""

    async def send(writer: asyncio.StreamWriter, request: Request) -> None:
        headers = [(b"content-type", b"application/octet-stream")]
        if announce_length:
            headers.append((b"content-length", b"%d" % len(body)))
        else:
            headers.append((b"connection", b"close"))
        writer.write(head(200, headers))
        await _drip(writer, body, every_s)

    return send


def trickle_head(every_s: float) -> Behaviour:
    """A response head sent one byte at a time, never finished within HANG_S."""

    async def send(writer: asyncio.StreamWriter, request: Request) -> None:
        await _drip(writer, b"HTTP/1.1 200 OK\r\nx-slow: " + b"a" * 100_000, every_s)

    return send


async def _drip(writer: asyncio.StreamWriter, data: bytes, every_s: float) -> None:
    """``data`` one byte every ``every_s`` seconds, for HANG_S at most; then close."""
    started = time.monotonic()
    for byte in data:
        if time.monotonic() - started > HANG_S:
            break
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(every_s)
    writer.close()


def hang() -> Behaviour:
    async def send(writer: asyncio.StreamWriter, request: Request) -> None:
        await asyncio.sleep(HANG_S)

    return send


def redirect(location: str, status: int = 302) -> Behaviour:
    async def send(writer: asyncio.StreamWriter, request: Request) -> None:
        writer.write(head(status, [(b"location", location.encode()), (b"content-length", b"0")]))
        await writer.drain()

    return send


def streamed(chunks: Callable[[], Iterator[bytes]], content_type: bytes) -> Behaviour:
    """A large body, generated as it is sent (chunked), e.g. a 40 MB index page."""

    async def send(writer: asyncio.StreamWriter, request: Request) -> None:
        writer.write(
            head(200, [(b"content-type", content_type), (b"transfer-encoding", b"chunked")])
        )
        for chunk in chunks():
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return send


# -- hostile clients ------------------------------------------------------------------------


def open_sockets(port: int, count: int, first_bytes: bytes) -> list[socket.socket]:
    """``count`` connections that each send ``first_bytes`` and then nothing."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if first_bytes:
            sock.sendall(first_bytes)
        sockets.append(sock)
    return sockets


def closed_by_server(sock: socket.socket, timeout_s: float) -> bytes | None:
    """What the server sent before closing ``sock``; None if it stayed open."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return received
            received += data
    except TimeoutError:
        return None
    except ConnectionError:
        return received

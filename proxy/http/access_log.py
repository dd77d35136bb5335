"""The access log: one line per request (method, path, status, bytes sent, duration,
cache outcome), on the ``proxy.access`` logger, as text or JSON (``runtime/logs.py``).

The dispatcher opens an ``Exchange`` per request and makes it the current one (a
context variable: every request runs in a task of its own); the cache notes what it
did (``note_outcome``: hit, miss, stale, negative...) and a response sent with
``sendfile`` notes the bytes that did not pass through ``send``. The line is formatted
by the logging handler, only when it is emitted (docs/architecture.md, "Operating:
console, API and logs").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from proxy.redaction import redact_url
from proxy.runtime import logs
from proxy.runtime.logs import ACCESS_LINE, ACCESS_LOGGER
from proxy.types import Message, Receive, Scope, Send

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger(ACCESS_LOGGER)


class Exchange:
    """What one request did, as the access log reports it. It is also the ``send`` the
    app is given (one object per request, no closure): it notes status and body bytes
    on their way to the server's ``send``."""

    __slots__ = ("cache", "downstream", "sent", "status")

    def __init__(self, downstream: Send) -> None:
        self.downstream = downstream
        self.status = 0
        self.sent = 0
        self.cache = "-"  # no cache involved (a health check, an error before lookup)

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            self.sent += len(message.get("body", b""))
        elif kind == "http.response.start":
            self.status = message["status"]
        await self.downstream(message)


CURRENT: ContextVar[Exchange | None] = ContextVar("proxy_exchange", default=None)


def note_outcome(outcome: str) -> None:
    """The cache's part in the current request: hit, miss, stale, negative, upload..."""
    exchange = CURRENT.get()
    if exchange is not None:
        exchange.cache = outcome


def note_sent(n_bytes: int) -> None:
    """Body bytes sent around ``send`` (sendfile)."""
    exchange = CURRENT.get()
    if exchange is not None:
        exchange.sent += n_bytes


def enabled() -> bool:
    return log.isEnabledFor(logging.INFO)


def write(
    client: str, method: str, path: str, query: bytes, exchange: Exchange, seconds: float
) -> None:
    if query:
        path = f"{path}?{query.decode('latin-1')}"
    if "=" in path or "@" in path:
        path = redact_url(path)  # a relative URL: its query's secrets are masked
    _line(client, method, path, exchange.status, exchange.sent, seconds, exchange.cache)


def _line(
    client: str, method: str, path: str, status: int, sent: int, seconds: float, cache: str
) -> None:
    lines = logs.ACCESS
    if lines is not None:
        lines.write(client, method, path, status, sent, seconds * 1000, cache)
    else:  # logging set up by someone else (tests, an embedding program)
        log.info(ACCESS_LINE, client, method, path, status, sent, seconds * 1000, cache)


def write_target(
    client: str, method: str, target: bytes, status: int, sent: int, seconds: float, cache: str
) -> None:
    """The line of a request the hit lane answered (``http/lane.py``): ``target`` is
    the path and query as sent, which the full path answered before (so a valid one)."""
    path = target.decode("latin-1")
    if "=" in path or "@" in path:
        path = redact_url(path)
    _line(client, method, path, status, sent, seconds, cache)


class AccessLogMiddleware:
    """Writes the access line of every HTTP request the app answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not enabled():
            await self.app(scope, receive, send)
            return
        exchange = Exchange(send)
        CURRENT.set(exchange)  # this request's task has a context of its own
        started = time.perf_counter()
        try:
            await self.app(scope, receive, exchange)
        except BaseException:
            if not exchange.status:
                exchange.status = 500
            raise
        finally:
            client = scope.get("client")
            raw_path = scope.get("raw_path")
            path = raw_path.decode("latin-1") if raw_path else scope["path"]
            write(
                client[0] if client else "-",
                scope["method"],
                path,
                scope.get("query_string", b""),
                exchange,
                time.perf_counter() - started,
            )

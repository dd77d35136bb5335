"""The holder's relay (docs/architecture.md, "Streaming across replicas on object
storage"): an internal HTTP listener of its own, on a socket apart from the public one
(``server.relay_listen``), that serves this process's in-flight downloads to the other
replicas waiting on its fetch leases, as they arrive.

A download is offered under its lease's fence with a random token
(``secrets.token_urlsafe``, 32 bytes); the holder writes the relay's URL and the token
into its lease row (``announce_stream``, fenced). ``GET /relay/<fence>`` with
``Authorization: Bearer <token>`` and ``Range: bytes=<offset>-`` is answered 206 with
the bytes from that offset as they become readable, the last one only once the holder
has verified the body, and ``X-Relay-Proof: HMAC-SHA256(token, "<fence>:<offset>:<total>")``
so the waiter knows it reached a relay that holds the token (and not whatever a forged
row pointed it at). Anything else is 403 (a wrong token, compared in constant time) or
404 (no download in flight under that fence, another path, another method): nothing
but an offered download can be read through it. An offer ends with its download.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from proxy.fetch.transfer import Transfer
from proxy.http.protocol import GuardedHttpToolsProtocol
from proxy.http.responses import NEVER_STORE, BodyResponse, DownloadResponse
from proxy.runtime import metrics
from proxy.types import Receive, Scope, Send

log = logging.getLogger("proxy.relay")

RELAY_PATH = "/relay/"
PROOF_HEADER = "x-relay-proof"
TOKEN_BYTES = 32
KEEP_ALIVE_S = 5
BACKLOG = 512
_RANGE_RE = re.compile(r"bytes=(\d{1,19})-")
_FENCE_RE = re.compile(r"[1-9][0-9]{0,18}")


def proof(token: str, fence: int, offset: int, total: int) -> str:
    """What a relay that holds ``token`` says about the bytes it sends."""
    message = f"{fence}:{offset}:{total}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Offer:
    fence: int
    token: str
    transfer: Transfer


class RelayServer:
    """This process's relay: its listener, and the downloads it offers, by fence."""

    def __init__(self, host: str, port: int, url: str | None) -> None:
        """``url``: what other replicas connect to (``server.relay_url``); None: derived
        from the bound socket (``url`` after ``start``)."""
        self.host = host
        self.port = port
        self.url = url or ""
        self._configured_url = url
        self._offers: dict[int, Offer] = {}
        self._server: asyncio.base_events.Server | None = None
        self._state = ServerState()

    async def start(self) -> None:
        config = uvicorn.Config(
            self,
            interface="asgi3",
            http=GuardedHttpToolsProtocol,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            server_header=False,
            date_header=False,
        )
        config.load()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            raise OSError(
                exc.errno, f"server.relay_listen: cannot listen on {self.host}:{self.port}"
            ) from exc
        sock.setblocking(False)
        state = self._state

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=state, app_state={}
            )

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(protocol, sock=sock)
        bound_port = sock.getsockname()[1]
        if self._configured_url is None:
            self.url = await derived_url(self.host, bound_port)
        log.info("relay listening on %s:%d, advertised as %s", self.host, bound_port, self.url)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for connection in list(self._state.connections):
            connection.shutdown()
        self._offers.clear()

    # -- offers ---------------------------------------------------------------------------

    def offer(self, fence: int, transfer: Transfer) -> str:
        """Serve ``transfer`` (our download under ``fence``) until ``withdraw``; the token."""
        token = secrets.token_urlsafe(TOKEN_BYTES)
        self._offers[fence] = Offer(fence, token, transfer)
        return token

    def withdraw(self, fence: int) -> None:
        self._offers.pop(fence, None)

    # -- the listener's app -----------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        response = self._answer(scope)
        await response(scope, receive, send)

    def _answer(self, scope: Scope) -> Any:
        path: str = scope["path"]
        fence_text = path[len(RELAY_PATH) :] if path.startswith(RELAY_PATH) else ""
        if scope["method"] != "GET" or not _FENCE_RE.fullmatch(fence_text):
            return _refuse(404, "not a relay path")
        offer = self._offers.get(int(fence_text))
        if offer is None:
            metrics.RELAY_REQUESTS.labels(result="unknown").inc()
            return _refuse(404, f"no download in flight under fence {fence_text}")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), offer.token.encode()
        ):
            metrics.RELAY_REQUESTS.labels(result="forbidden").inc()
            log.warning("relay: refused a request for fence %s with a wrong token", fence_text)
            return _refuse(403, "wrong relay token")
        transfer = offer.transfer
        if transfer.error is not None:
            metrics.RELAY_REQUESTS.labels(result="failed").inc()
            return _refuse(404, "the download failed")
        total = transfer.total
        offset = 0
        requested = headers.get("range")
        if requested is not None:
            match = _RANGE_RE.fullmatch(requested.strip())
            if match is None or int(match.group(1)) >= total:
                return _refuse(416, f"range {requested!r}: only bytes=N- with N < {total}")
            offset = int(match.group(1))
        metrics.RELAY_REQUESTS.labels(result="served").inc()
        answer_headers = [
            (b"content-type", b"application/octet-stream"),
            (b"cache-control", NEVER_STORE),
            (b"content-length", str(total - offset).encode()),
            (b"content-range", f"bytes {offset}-{total - 1}/{total}".encode()),
            (PROOF_HEADER.encode(), proof(offer.token, offer.fence, offset, total).encode()),
        ]
        return DownloadResponse(
            answer_headers, transfer, "(relay)", False, 206, offset, total - offset
        )


def _refuse(status: int, message: str) -> BodyResponse:
    body = (message + "\n").encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", NEVER_STORE),
    ]
    return BodyResponse(status, headers, body)


async def derived_url(host: str, port: int) -> str:
    """The URL other replicas reach a relay bound to ``host``:``port`` at: that address,
    or, for a wildcard bind (0.0.0.0, ::), this host's own address by its name (in
    Kubernetes, the pod's IP; in compose, the container's)."""
    if host in ("0.0.0.0", "::", ""):
        loop = asyncio.get_running_loop()
        name = socket.gethostname()
        try:
            infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            host = str(infos[0][4][0])
        except (OSError, IndexError):
            host = name
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"

"""Talking to upstreams: one httpx client, streaming GETs, retries, error mapping; the
engine's implementation of ``contract.UpstreamClient``.

httpx errors are translated here, once, into ``UpstreamError`` subclasses. Only
idempotent requests are sent, so connection failures and 429/5xx answers are retried
with backoff; a read timeout is not (a hanging upstream must cost one timeout, not
several), and nothing is retried once body bytes have been handed on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

import httpx

from proxy import __version__, metrics
from proxy.exceptions import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from proxy.settings import UpstreamSettings

log = logging.getLogger("proxy.upstream")

BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 4.0
RETRY_AFTER_MAX_S = 5.0
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
USER_AGENT = f"artifact-proxy/{__version__}"


def build_client(settings: UpstreamSettings) -> httpx.AsyncClient:
    timeout = httpx.Timeout(
        connect=settings.connect_timeout_s,
        read=settings.read_timeout_s,
        write=settings.read_timeout_s,
        pool=settings.connect_timeout_s,
    )
    limits = httpx.Limits(
        max_connections=settings.max_connections,
        max_keepalive_connections=min(settings.max_connections, 20),
    )
    return httpx.AsyncClient(
        timeout=timeout,
        limits=limits,
        follow_redirects=True,
        max_redirects=10,
        headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
    )


class Upstream:
    """Streaming GET/HEAD against upstream URLs with the proxy's retry policy."""

    def __init__(self, client: httpx.AsyncClient, settings: UpstreamSettings) -> None:
        self.client = client
        self.retries = settings.retries
        self.read_timeout_s = settings.read_timeout_s

    @asynccontextmanager
    async def open(
        self, method: str, url: str, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[UpstreamAnswer]:
        """Open ``method url``; retried on connection errors and 429/5xx. Statuses other
        than those retried are returned as is; the caller reads the body (or not).
        """
        host = urlsplit(url).netloc
        attempt = 0
        while True:
            request = self.client.build_request(method, url, headers=headers)
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TimeoutException as exc:
                metrics.UPSTREAM_ERRORS.labels(host=host, reason="timeout").inc()
                if (
                    isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
                    and attempt < self.retries
                ):
                    attempt += 1
                    await asyncio.sleep(_backoff_s(attempt))
                    continue
                raise UpstreamTimeout(f"upstream {host} timed out ({type(exc).__name__})") from exc
            except httpx.TransportError as exc:
                metrics.UPSTREAM_ERRORS.labels(host=host, reason="connect").inc()
                if (
                    isinstance(exc, httpx.ConnectError | httpx.RemoteProtocolError)
                    and attempt < self.retries
                ):
                    attempt += 1
                    await asyncio.sleep(_backoff_s(attempt))
                    continue
                raise UpstreamUnavailable(f"upstream {host} unreachable: {exc!r}") from exc
            except httpx.HTTPError as exc:  # e.g. TooManyRedirects, InvalidURL
                metrics.UPSTREAM_ERRORS.labels(host=host, reason="protocol").inc()
                raise UpstreamUnavailable(f"upstream {host}: {exc}") from exc
            if response.status_code in RETRY_STATUSES:
                metrics.UPSTREAM_ERRORS.labels(host=host, reason=str(response.status_code)).inc()
                retry_after = _retry_after_s(response.headers.get("retry-after"))
                await response.aclose()
                if attempt < self.retries:
                    attempt += 1
                    await asyncio.sleep(min(retry_after or _backoff_s(attempt), RETRY_AFTER_MAX_S))
                    continue
                status = 503 if response.status_code in (429, 503) else 502
                raise UpstreamUnavailable(
                    f"upstream {host} answered {response.status_code} for {url}",
                    status=status,
                    retry_after_s=retry_after,
                )
            try:
                yield UpstreamAnswer(response)
            finally:
                await response.aclose()
            return


class UpstreamAnswer:
    """``contract.UpstreamResponse`` over an httpx response whose body is unread."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    @property
    def url(self) -> str:
        return str(self._response.url)

    @property
    def length(self) -> int | None:
        return content_length(self._response)

    def body(self) -> AsyncIterator[bytes]:
        return iter_body(self._response)

    async def read(self, limit: int) -> bytes:
        return await read_body(self._response, limit)


async def iter_body(response: httpx.Response) -> AsyncIterator[bytes]:
    """The decoded body, with transport errors translated; checks Content-Length."""
    host = response.request.url.netloc.decode()
    expected = content_length(response)
    received = 0
    try:
        async for chunk in response.aiter_bytes():
            received += len(chunk)
            yield chunk
    except httpx.TimeoutException as exc:
        metrics.UPSTREAM_ERRORS.labels(host=host, reason="timeout").inc()
        raise UpstreamTimeout(f"upstream {host} stopped sending ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        metrics.UPSTREAM_ERRORS.labels(host=host, reason="truncated").inc()
        raise UpstreamUnavailable(f"upstream {host} broke off the body: {exc!r}") from exc
    if expected is not None and received != expected:
        metrics.UPSTREAM_ERRORS.labels(host=host, reason="truncated").inc()
        raise UpstreamUnavailable(
            f"upstream {host} sent {received} of {expected} bytes for {response.request.url}"
        )


async def read_body(response: httpx.Response, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes (index pages, checksum files)."""
    chunks = []
    size = 0
    async for chunk in iter_body(response):
        size += len(chunk)
        if size > limit:
            raise UpstreamError(f"upstream body for {response.request.url} exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def content_length(response: httpx.Response) -> int | None:
    """The body size, if the upstream stated it for the bytes we will see (not encoded)."""
    if response.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
        return None
    value = response.headers.get("content-length")
    if value is None or not value.isdigit():
        return None
    return int(value)


def _backoff_s(attempt: int) -> float:
    base_s: float = min(BACKOFF_BASE_S * 2.0 ** (attempt - 1), BACKOFF_MAX_S)
    return base_s * random.uniform(0.5, 1.0)


def _retry_after_s(value: str | None) -> float | None:
    if not value:
        return None
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, float(when.timestamp()) - time.time())

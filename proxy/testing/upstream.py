"""A ``contract.UpstreamClient`` that answers with a handler function, as httpx's
``MockTransport`` does (docs/architecture.md, "Test seams").
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

from proxy.contract import UpstreamResponse
from proxy.exceptions import UpstreamUnavailable


@dataclass(frozen=True)
class UpstreamRequest:
    """What an origin asked the upstream."""

    method: str
    url: str
    headers: Mapping[str, str]  # lower-case names


@dataclass
class MockResponse:
    """What the handler answers: a status, headers and a body (bytes, or chunks).

    ``chunked``: no length is stated (as a chunked upstream answer). ``break_after``:
    the body breaks off after this many bytes (``UpstreamUnavailable``, as a reset
    connection does), although its full length was stated.
    """

    status: int = 200
    body: bytes | Sequence[bytes] = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    url: str | None = None  # the final URL, after redirects (default: the one asked)
    chunked: bool = False
    break_after: int | None = None


Handler = Callable[[UpstreamRequest], "MockResponse | Awaitable[MockResponse]"]


class _MockAnswer:
    """``contract.UpstreamResponse`` over a ``MockResponse``."""

    def __init__(self, response: MockResponse, url: str) -> None:
        self._response = response
        self._url = response.url or url
        self._headers = {k.lower(): v for k, v in response.headers.items()}
        body = response.body
        self._chunks = [body] if isinstance(body, bytes) else list(body)

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    @property
    def url(self) -> str:
        return self._url

    @property
    def length(self) -> int | None:
        return None if self._response.chunked else sum(len(c) for c in self._chunks)

    async def body(self) -> AsyncIterator[bytes]:
        sent = 0
        limit = self._response.break_after
        for chunk in self._chunks:
            await asyncio.sleep(0)
            if limit is not None and sent + len(chunk) > limit:
                if limit > sent:
                    yield chunk[: limit - sent]
                raise UpstreamUnavailable(f"mock upstream broke off the body of {self._url}")
            sent += len(chunk)
            if chunk:
                yield chunk

    async def read(self, limit: int) -> bytes:
        chunks = []
        size = 0
        async for chunk in self.body():
            size += len(chunk)
            if size > limit:
                raise UpstreamUnavailable(f"upstream body for {self._url} exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


class MockUpstream:
    """``contract.UpstreamClient`` answering with ``handler(request)`` (a function or a
    coroutine function, like httpx's ``MockTransport``). The handler may raise an
    ``UpstreamError`` to play an outage. Every request is kept in ``requests``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[UpstreamRequest] = []

    def count(self, url: str, method: str = "GET") -> int:
        return sum(1 for r in self.requests if r.url == url and r.method == method)

    def open(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        *,
        beside: UpstreamResponse | None = None,
    ) -> AbstractAsyncContextManager[UpstreamResponse]:
        return self._open(method, url, headers or {})

    @asynccontextmanager
    async def _open(
        self, method: str, url: str, headers: Mapping[str, str]
    ) -> AsyncIterator[UpstreamResponse]:
        request = UpstreamRequest(method, url, {k.lower(): v for k, v in headers.items()})
        self.requests.append(request)
        answer = self.handler(request)
        if inspect.isawaitable(answer):
            answer = await answer
        assert isinstance(answer, MockResponse), f"the handler answered {answer!r}"
        yield _MockAnswer(answer, url)


def static_upstream(
    files: Mapping[str, bytes | MockResponse],
) -> Callable[[UpstreamRequest], MockResponse]:
    """A handler serving ``files`` (URL -> body or answer); any other URL is a 404."""

    def handler(request: UpstreamRequest) -> MockResponse:
        found = files.get(request.url)
        if found is None:
            return MockResponse(404, b"not found\n")
        return found if isinstance(found, MockResponse) else MockResponse(200, found)

    return handler

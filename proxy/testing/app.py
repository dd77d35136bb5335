"""The whole app in memory (docs/architecture.md, "Test seams"): engine, formats and the
error table on a ``MemoryCatalog`` and a ``MockUpstream``, without a socket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx

from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.config.settings import Settings
from proxy.engine import Engine, Seams
from proxy.http.app import create_app
from proxy.testing.catalog import MemoryCatalog
from proxy.testing.upstream import Handler, MockUpstream


class InMemoryProxy:
    """The proxy's app (engine, every configured format, the error table) on a
    ``MemoryCatalog`` and a ``MockUpstream``, called without a socket::

        async with InMemoryProxy(settings, handler, clock) as proxy:
            response = await proxy.client.get("/pypi/simple/demo/")

    ``settings.storage_path`` must be a folder of the test's own: blobs are real files.
    """

    def __init__(self, settings: Settings, handler: Handler, clock: Clock = SYSTEM_CLOCK) -> None:
        self.settings = settings
        self.clock = clock
        self.catalog = MemoryCatalog(clock)
        self.upstream = MockUpstream(handler)
        self._stack = contextlib.AsyncExitStack()
        self.engine: Engine
        self.client: httpx.AsyncClient

    async def __aenter__(self) -> InMemoryProxy:
        app = create_app(
            self.settings, self.clock, seams=Seams(catalog=self.catalog, upstream=self.upstream)
        )
        lifespan: Callable[[Any], AbstractAsyncContextManager[dict[str, Any]]]
        lifespan = app.router.lifespan_context  # type: ignore[assignment]
        state = await self._stack.enter_async_context(lifespan(app))
        self.engine = state["proxy"]

        async def with_state(scope: Any, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        self.client = await self._stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://proxy.test")
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

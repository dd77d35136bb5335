"""The ASGI application: the lifespan builds every resource; routes dispatch to formats.

Resources are built in the lifespan and handed to requests through the lifespan state
(``scope["state"]["proxy"]``); there are no globals besides the Prometheus metrics.
This module and ``config.py`` are the only ones that look formats up in the registry
(docs/architecture.md, "Module map").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from proxy import formats, metrics, responses
from proxy.blobs import BlobStore
from proxy.blocking import install_io_executor, run_blocking
from proxy.cache import Cache
from proxy.catalog import Catalog, open_catalog
from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.contract import Adapter, FormatContext, Request
from proxy.contract import Response as ASGIResponse
from proxy.entry_index import AccessLog, EntryIndex
from proxy.exceptions import (
    CatalogError,
    ClientError,
    NotConfigured,
    ProxyError,
    ShuttingDown,
    StorageError,
    UpstreamError,
    UpstreamUnavailable,
)
from proxy.fetch import Fetcher
from proxy.jobs import Scheduler, standard_jobs
from proxy.leases import LeaseCoordinator, make_holder_id
from proxy.paths import check_headers, split_path
from proxy.responses import HotBlobs
from proxy.settings import Settings
from proxy.tasks import TaskSupervisor
from proxy.types import Receive, Scope, Send
from proxy.upstream import Upstream, build_client

log = logging.getLogger("proxy.app")

ACCESS_FLUSH_INTERVAL_S = 5.0
SHUTDOWN_TASK_TIMEOUT_S = 10.0
READY_CHECK_TIMEOUT_S = 2.0
BODY_METHODS = frozenset({"PUT", "POST", "PATCH"})
KNOWN_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS"})


@dataclass
class ProxyState:
    settings: Settings
    catalog: Catalog
    blobs: BlobStore
    cache: Cache
    adapters: dict[str, Adapter]
    tasks: TaskSupervisor
    leases: LeaseCoordinator
    holder: str


class ShutdownSignal:
    """How the process owner (``proxy/server.py``) starts the app's shutdown early.

    The server drains open connections before the lifespan shutdown runs; a client
    streaming a download would hold our fetch leases for that whole time. ``request``
    (thread-safe, callable from a signal handler) starts our own shutdown at once:
    fetches are cancelled and their leases released, so another replica takes over in
    milliseconds (docs/architecture.md, "Clean shutdown").
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._target: tuple[asyncio.AbstractEventLoop, Callable[[], object]] | None = None
        self.requested = False

    def attach(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
        with self._lock:
            self._target = (loop, callback)
            if self.requested:
                loop.call_soon_threadsafe(callback)

    def detach(self) -> None:
        with self._lock:
            self._target = None

    def request(self) -> None:
        with self._lock:
            self.requested = True
            if self._target is not None:
                loop, callback = self._target
                with contextlib.suppress(RuntimeError):  # the loop has just closed
                    loop.call_soon_threadsafe(callback)


def create_app(
    settings: Settings, clock: Clock = SYSTEM_CLOCK, shutdown: ShutdownSignal | None = None
) -> Starlette:
    shutdown = shutdown or ShutdownSignal()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        install_io_executor(asyncio.get_running_loop())
        blobs = BlobStore(settings.storage_path)
        await run_blocking(blobs.prepare)
        catalog = open_catalog(settings.database_url, clock)
        applied = await catalog.migrate()
        if applied:
            log.info("applied migrations: %s", ", ".join(applied))
        client = build_client(settings.upstream)
        upstream = Upstream(client, settings.upstream)
        tasks = TaskSupervisor()
        holder = make_holder_id()
        leases = LeaseCoordinator(catalog, settings.leases, tasks, holder, clock)
        index, access, hot = EntryIndex(), AccessLog(clock), HotBlobs()
        fetcher = Fetcher(catalog, blobs, index, leases, tasks, clock)
        cache = Cache(catalog, blobs, fetcher, index, access, hot, clock)
        adapters: dict[str, Adapter] = {}
        size_limits: dict[str, int] = {}
        for repo in settings.repositories:
            plugin = formats.plugin(repo.format)
            view = cache.for_repository(repo.name, repo.format, upstream)
            context = FormatContext(cache=view, upstream=upstream, links=view.links)
            adapters[repo.name] = plugin.build(repo, context)
            limit = plugin.max_size(repo.options) if plugin.max_size else None
            if limit is not None:
                size_limits[repo.name] = limit
            for warning in plugin.warnings(repo, settings.host) if plugin.warnings else ():
                log.warning("%s", warning)
            if repo.is_proxy and not repo.upstreams:
                log.warning(
                    "repository %r has no upstream: its requests get 503 until you set %s",
                    repo.name,
                    repo.upstream_setting,
                )
        state = ProxyState(settings, catalog, blobs, cache, adapters, tasks, leases, holder)

        tasks.spawn("access-flush", _flush_access_forever(cache))
        if settings.leases.notify:
            tasks.spawn("lease-listener", catalog.listen_leases(leases.notify))
        scheduler = Scheduler(catalog, holder, tasks)
        for job in standard_jobs(settings, catalog, blobs, cache, clock, size_limits):
            scheduler.add(job)
        scheduler.start()

        stopping: asyncio.Future[None] | None = None

        async def stop_work() -> None:
            # Cancel fetches first: each releases its lease as it unwinds, so another
            # replica takes over at once; then release anything left and wait for it.
            await tasks.close(SHUTDOWN_TASK_TIMEOUT_S)
            await leases.release_all()

        def begin_shutdown() -> asyncio.Future[None]:
            nonlocal stopping
            if stopping is None:
                stopping = asyncio.ensure_future(stop_work())
            return stopping

        shutdown.attach(asyncio.get_running_loop(), begin_shutdown)
        log.info(
            "proxy ready: holder=%s catalog=%s storage=%s repositories=%s",
            holder,
            catalog.backend,
            settings.storage_path,
            ", ".join(f"/{r.name}/ ({r.format})" for r in settings.repositories),
        )
        try:
            yield {"proxy": state}
        finally:
            shutdown.detach()
            await begin_shutdown()
            flushed = await cache.flush_access()
            log.info("shut down: flushed %d access times", flushed)
            await client.aclose()
            await catalog.close()
            # With several workers, drop this process's live gauges from the aggregate.
            metrics.mark_process_dead(os.getpid())

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET", "HEAD"]),
            Route("/readyz", readyz, methods=["GET", "HEAD"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/{path:path}", Dispatcher()),
        ],
        lifespan=lifespan,
    )


async def _flush_access_forever(cache: Cache) -> None:
    while True:
        await asyncio.sleep(ACCESS_FLUSH_INTERVAL_S)
        await cache.flush_access()


class Dispatcher:
    """``/{repository}/...`` -> the repository's format adapter, with errors as 4xx/5xx."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: ProxyState = scope["state"]["proxy"]
        started = time.perf_counter()
        method = scope["method"]
        repository = "-"
        status_seen = 500

        async def send_counting(message: Any) -> None:
            nonlocal status_seen
            if message["type"] == "http.response.start":
                status_seen = message["status"]
            await send(message)

        try:
            try:
                check_headers(scope["headers"])
                name, path = split_path(scope.get("raw_path") or scope["path"].encode())
                adapter = state.adapters.get(name)
                if adapter is None:
                    response = _landing(state) if scope["path"] == "/" else _unknown(name, state)
                else:
                    repository = name
                    headers = {
                        k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                    }
                    base_path = f"{scope.get('root_path', '')}/{repository}/"
                    request = Request(method, repository, path, headers, base_path, receive)
                    response = await adapter.handle(request)
            except ProxyError as exc:
                response = _error_response(exc, state)
            if (
                method in BODY_METHODS
                and isinstance(response, responses.BodyResponse)
                and response.status >= 400
            ):
                # The body may be unread (e.g. a 413 or 401 after Expect: 100-continue):
                # close the connection so it is never parsed as the next request.
                response.headers.append((b"connection", b"close"))
            await response(scope, receive, send_counting)
        finally:
            method_label = method if method in KNOWN_METHODS else "other"
            metrics.REQUESTS.labels(repository, method_label, str(status_seen)).inc()
            metrics.REQUEST_DURATION.labels(repository).observe(time.perf_counter() - started)


def _error_response(exc: ProxyError, state: ProxyState) -> ASGIResponse:
    if isinstance(exc, ClientError):
        return responses.error(exc.status, str(exc))
    if isinstance(exc, UpstreamUnavailable):
        extra = {}
        if exc.status == 503:
            extra["retry-after"] = str(int(exc.retry_after_s or 5))
        return responses.error(exc.status, str(exc), extra)
    if isinstance(exc, UpstreamError):
        return responses.error(exc.status, str(exc))
    if isinstance(exc, NotConfigured | ShuttingDown):
        return responses.error(503, str(exc), {"retry-after": "5"})
    if isinstance(exc, CatalogError):
        log.error("catalog error: %s", exc)
        return responses.error(
            503, "the cache database is unavailable; try again", {"retry-after": "5"}
        )
    if isinstance(exc, StorageError):
        log.error("storage error: %s", exc)
        return responses.error(
            503, "the cache storage is unavailable; try again", {"retry-after": "5"}
        )
    log.error("unexpected proxy error: %r", exc)
    return responses.error(500, f"internal error: {type(exc).__name__}")


def _unknown(repository: str, state: ProxyState) -> ASGIResponse:
    known = ", ".join(f"/{name}/" for name in state.adapters) or "none"
    return responses.error(404, f"no repository named {repository!r}; configured: {known}")


def _landing(state: ProxyState) -> ASGIResponse:
    lines = ["artifact proxy", ""]
    for repo in state.settings.repositories:
        line = f"/{repo.name}/  format={repo.format}"
        if repo.is_proxy:
            upstreams = ", ".join(repo.upstreams) or "NOT SET: set " + repo.upstream_setting
            line += f"  upstream={upstreams}"
        lines.append(line)
    lines += ["", "/healthz  /readyz  /metrics"]
    return responses.error(200, "\n".join(lines))


async def healthz(request: StarletteRequest) -> Response:
    return PlainTextResponse("ok\n")


async def readyz(request: StarletteRequest) -> Response:
    state: ProxyState = request.state.proxy
    problems = []
    try:
        async with asyncio.timeout(READY_CHECK_TIMEOUT_S):
            await state.catalog.ping()
    except (CatalogError, TimeoutError) as exc:
        problems.append(f"catalog: {exc or 'timed out'}")
    try:
        await run_blocking(state.blobs.check_writable)
    except OSError as exc:
        problems.append(f"storage: {exc}")
    if state.tasks.closing:
        problems.append("shutting down")
    if problems:
        return PlainTextResponse("not ready: " + "; ".join(problems) + "\n", status_code=503)
    return PlainTextResponse("ready\n")


async def metrics_endpoint(request: StarletteRequest) -> Response:
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)

"""The ASGI application: the lifespan builds every resource; routes dispatch to formats.

Resources are built in the lifespan and handed to requests through the lifespan state
(``scope["state"]["proxy"]``); there are no globals besides the Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
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

from proxy import config as config_module
from proxy import metrics, responses
from proxy.blobs import BlobStore
from proxy.blocking import install_io_executor, run_blocking
from proxy.cache import Cache
from proxy.catalog import Catalog, open_catalog
from proxy.config import RepositorySettings, Settings
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
from proxy.formats import Adapter, ASGIResponse, Request
from proxy.jobs import Scheduler, standard_jobs
from proxy.leases import LeaseCoordinator, make_holder_id
from proxy.logs import configure_logging
from proxy.paths import check_headers, split_path
from proxy.responses import HotBlobs
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


def build_adapter(repo: RepositorySettings, cache: Cache, upstream: Upstream) -> Adapter:
    if repo.format == "pypi":
        from proxy.formats.pypi import PypiRepository

        return PypiRepository(repo, cache, upstream)
    if repo.format == "maven":
        from proxy.formats.maven import MavenRepository

        return MavenRepository(repo, cache, upstream)
    from proxy.formats.gradle_cache import BuildCacheRepository

    return BuildCacheRepository(repo, cache)


def create_app(settings: Settings) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        install_io_executor(asyncio.get_running_loop())
        blobs = BlobStore(settings.storage_path)
        blobs.prepare()
        catalog = open_catalog(settings.database_url)
        applied = await catalog.migrate()
        if applied:
            log.info("applied migrations: %s", ", ".join(applied))
        client = build_client(settings.upstream)
        upstream = Upstream(client, settings.upstream)
        tasks = TaskSupervisor()
        holder = make_holder_id()
        leases = LeaseCoordinator(catalog, settings.leases, tasks, holder)
        index, access, hot = EntryIndex(), AccessLog(), HotBlobs()
        fetcher = Fetcher(catalog, blobs, index, leases, tasks)
        cache = Cache(catalog, blobs, fetcher, index, access, hot)
        adapters = {
            repo.name: build_adapter(repo, cache, upstream) for repo in settings.repositories
        }
        _warn_about_settings(settings)
        state = ProxyState(settings, catalog, blobs, cache, adapters, tasks, leases, holder)

        tasks.spawn("access-flush", _flush_access_forever(access, catalog))
        if settings.leases.notify:
            tasks.spawn("lease-listener", catalog.listen_leases(leases.notify))
        scheduler = Scheduler(catalog, holder, tasks)
        for job in standard_jobs(settings, catalog, blobs, cache):
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

        restore = _chain_exit_signals(asyncio.get_running_loop(), begin_shutdown)
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
            restore()
            await begin_shutdown()
            flushed = await access.flush(catalog)
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


def _warn_about_settings(settings: Settings) -> None:
    """Log, once at start, the settings an operator most likely has to act on."""
    loopback = settings.host in ("127.0.0.1", "::1", "localhost")
    for repo in settings.repositories:
        if repo.is_proxy and not repo.upstreams:
            log.warning(
                "repository %r has no upstream: its requests get 503 until you set %s",
                repo.name,
                repo.upstream_setting,
            )
        if repo.format == "gradle-build-cache" and repo.anonymous == "write" and not loopback:
            log.warning(
                'repository %r lets anyone write (anonymous = "write") while listening on %s: '
                "set repositories.%s.anonymous and add users",
                repo.name,
                settings.host,
                repo.name,
            )


def create_app_from_environment() -> Starlette:
    """Factory for ``uvicorn --factory`` and worker processes: settings from the environment."""
    configure_logging(os.environ.get("PROXY_LOG_LEVEL", "info"))
    return create_app(config_module.load(None, os.environ))


async def _flush_access_forever(access: AccessLog, catalog: Catalog) -> None:
    while True:
        await asyncio.sleep(ACCESS_FLUSH_INTERVAL_S)
        await access.flush(catalog)


def _chain_exit_signals(
    loop: asyncio.AbstractEventLoop, hook: Callable[[], object]
) -> Callable[[], None]:
    """Start our shutdown the moment SIGTERM/SIGINT arrives, before the server drains.

    The server waits for open connections before it runs the lifespan shutdown; a
    client streaming a download would hold our fetch leases for that whole time.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, frame: Any) -> None:
        loop.call_soon_threadsafe(hook)
        chained = previous[signal.Signals(signum)]
        if callable(chained):
            chained(signum, frame)

    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, old)

    return restore


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
                    request = Request(method, repository, path, headers, scope, receive)
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
            line += (
                f"  upstream={', '.join(repo.upstreams) or 'NOT SET: set ' + repo.upstream_setting}"
            )
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

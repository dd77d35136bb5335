"""The ASGI application: the lifespan opens the engine; routes dispatch to formats.

The engine (``engine.py``) is handed to requests through the lifespan state
(``scope["state"]["proxy"]``); there are no globals besides the Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as StarletteRequest
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from proxy import admin
from proxy.admin.requests import AdminState
from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.config.load import EMBEDDED_DEFAULTS, load
from proxy.config.settings import Settings
from proxy.contract import Request
from proxy.contract import Response as ASGIResponse
from proxy.engine import Engine, Seams, open_engine
from proxy.exceptions import CatalogError, ConfigError, NotConfigured, NotFound
from proxy.http import errors, responses
from proxy.http.access_log import AccessLogMiddleware
from proxy.http.lane import TICKET, LaneTicket
from proxy.http.paths import (
    check_headers,
    escapes_only_what_it_must,
    request_headers,
    split_path,
)
from proxy.redaction import redact
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.types import Receive, Scope, Send

log = logging.getLogger("proxy.app")

READY_CHECK_TIMEOUT_S = 2.0
BODY_METHODS = frozenset({"PUT", "POST", "PATCH"})
KNOWN_METHODS = frozenset({"GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS"})
# What an answer naming the proxy by the client's URL varies with (Request.base_url):
# the Host, and the scheme a trusted balancer forwards.
VARY_CLIENT_URL = ("Host", "X-Forwarded-Proto")


class LoopSignal:
    """A request made from a signal handler of the process owner
    (``proxy/http/server.py``), run as ``callback`` on the app's event loop. A handler
    may interrupt anything on the main thread, even itself: so no lock, only single
    assignments (atomic), and a callback that tolerates being scheduled twice. One asked
    for before the app is ready runs once it is."""

    def __init__(self) -> None:
        self._target: tuple[asyncio.AbstractEventLoop, Callable[[], object]] | None = None
        self.requested = False

    def attach(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
        self._target = (loop, callback)
        if self.requested:  # asked before we were ready: start now
            loop.call_soon_threadsafe(callback)

    def detach(self) -> None:
        self._target = None

    def request(self) -> None:
        self.requested = True
        target = self._target
        if target is not None:
            loop, callback = target
            with contextlib.suppress(RuntimeError):  # the loop has just closed
                loop.call_soon_threadsafe(callback)


class ShutdownSignal(LoopSignal):
    """How the process owner starts the app's shutdown early (SIGTERM, SIGINT).

    The server drains open connections before the lifespan shutdown runs; a client
    streaming a download would hold our fetch leases for that whole time. ``request``
    starts our own shutdown at once: fetches are cancelled and their leases released,
    so another replica takes over in milliseconds (docs/architecture.md, "Clean
    shutdown").
    """


class ReloadSignal(LoopSignal):
    """How the process owner asks for ``[policy]`` to be read again (SIGHUP): see
    ``reload_policy``."""


async def reload_policy(engine: Engine, settings: Settings) -> bool:
    """Read the configuration ``settings`` came from again and apply its ``[policy]``
    (and the repositories' ``cooldown``) to ``engine``; nothing else of it changes
    (docs/architecture.md, "Release policy"). A file with errors keeps the policy in
    force and logs each error with its key. True if the new policy applies."""
    path = None if settings.source == EMBEDDED_DEFAULTS else settings.source
    try:
        # The environment is read again too: it overrides the file as at start.
        reloaded = await run_blocking(load, path, dict(os.environ))
    except ConfigError as exc:
        for error in exc.errors:
            log.error("policy reload: %s", redact(error))
        log.error("policy reload failed: the policy in force stays")
        metrics.POLICY_RELOADS.labels("failed").inc()
        return False
    engine.reload_policy(reloaded)
    metrics.POLICY_RELOADS.labels("ok").inc()
    log.info("policy reloaded from %s", reloaded.source)
    return True


def create_app(
    settings: Settings,
    clock: Clock = SYSTEM_CLOCK,
    shutdown: ShutdownSignal | None = None,
    seams: Seams | None = None,
    reload: ReloadSignal | None = None,
) -> Starlette:
    shutdown = shutdown or ShutdownSignal()
    reload = reload or ReloadSignal()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        async with open_engine(settings, clock, seams) as engine:
            engine.start_background()
            loop = asyncio.get_running_loop()
            shutdown.attach(loop, engine.stop)

            def start_reload() -> None:
                with contextlib.suppress(RuntimeError):  # shutting down: nothing to reload
                    engine.tasks.spawn("policy-reload", reload_policy(engine, settings))

            reload.attach(loop, start_reload)
            log.info(
                "proxy ready: holder=%s catalog=%s storage=%s repositories=%s",
                engine.holder,
                engine.catalog.backend,
                engine.storage.description,
                ", ".join(f"/{r.name}/ ({r.format})" for r in settings.repositories),
            )
            try:
                yield {
                    "proxy": engine,
                    "admin": AdminState.of(engine, settings),
                    "lane": engine.lane,  # the protocol answers from it (http/lane.py)
                }
            finally:
                reload.detach()
                shutdown.detach()
                if engine.lane is not None:
                    engine.lane.flush()  # its last hits' counts and access times

    return Starlette(
        routes=matching_any_character(
            [
                Route("/healthz", healthz, methods=["GET", "HEAD"]),
                Route("/readyz", readyz, methods=["GET", "HEAD"]),
                Route("/metrics", metrics_endpoint, methods=["GET"]),
                *admin.routes(),
                Route("/{path:path}", Dispatcher()),
            ]
        ),
        middleware=[Middleware(AccessLogMiddleware)],
        lifespan=lifespan,
    )


def matching_any_character(routes: list[BaseRoute]) -> list[BaseRoute]:
    """``routes``, their patterns matching paths with a newline too (a client's ``%0A``).
    Starlette's ``.*`` stops at one, so such a path matched no route: Starlette's plain
    "Not Found" (which npm does not show, where the API answers JSON), or a redirect
    to the path without its slash; matched, the format or the admin page judges it and
    says why in its own words."""
    for route in routes:
        if isinstance(route, Route | Mount):
            route.path_regex = re.compile(route.path_regex.pattern, re.DOTALL)
        if isinstance(route, Mount):
            matching_any_character(route.routes)
    return routes


class Dispatcher:
    """``/{repository}/...`` -> the repository's format adapter; whatever is raised on the
    way becomes the answer the error table gives it (``http/errors.py``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: Engine = scope["state"]["proxy"]
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
                name, raw_path = split_path(scope.get("raw_path") or scope["path"].encode())
                adapter = state.adapters.get(name)
                if adapter is None:
                    if scope["path"] != "/":
                        raise _unknown(name, state)
                    response = _landing(state)
                else:
                    repository = name
                    if name in state.not_configured:
                        raise NotConfigured(state.not_configured[name])
                    headers = request_headers(scope["headers"])
                    base_path = f"{scope.get('root_path', '')}/{repository}/"
                    request = Request(
                        method,
                        repository,
                        raw_path,
                        headers,
                        base_path,
                        receive,
                        query=scope.get("query_string", b"").decode("latin-1"),
                        scheme="https" if scope.get("scheme") == "https" else "http",
                        public_url=state.settings.public_url,
                        client=(scope.get("client") or ("", 0))[0],
                    )
                    ticket = None
                    if method == "GET" and state.lane is not None:
                        ticket = LaneTicket(state.lane.epoch)
                        TICKET.set(ticket)  # this request's task has a context of its own
                    response = await adapter.handle(request)
                    if request.named_by_client:
                        # Built with the Host the client sent: kept by no one for others.
                        responses.vary_on(response, VARY_CLIENT_URL)
                    elif ticket is not None and isinstance(response, responses.BodyResponse):
                        _offer(state, scope, response, ticket)
            except Exception as exc:
                accept = next((v for k, v in scope["headers"] if k == b"accept"), b"")
                response = errors.answer(
                    exc, repository, repository in state.json_errors, accept.decode("latin-1")
                )
            if (
                method in BODY_METHODS
                and isinstance(response, responses.BodyResponse)
                and response.status >= 400
                and _expects_continue(scope)
            ):
                # The body may never come (a 413 or 401 answered instead of 100
                # Continue): close, so that what the client sends next is never parsed as
                # the rest of this body. A client that sends its body without asking is
                # kept: the parser skips what is left of the body (up to a bound,
                # http.protocol), and the client reads our answer instead of a reset
                # that closing under its unread bytes would send it.
                response.headers.append((b"connection", b"close"))
            await response(scope, receive, send_counting)
        finally:
            method_label = method if method in KNOWN_METHODS else "other"
            metrics.REQUESTS.labels(repository, method_label, str(status_seen)).inc()
            metrics.REQUEST_DURATION.labels(repository).observe(time.perf_counter() - started)


def _offer(
    state: Engine, scope: Scope, response: responses.BodyResponse, ticket: LaneTicket
) -> None:
    """File a GET's answer in the hit lane (``http/lane.py``), keyed by the request
    target exactly as the protocol reads it. Not with a query string: no client's
    request for a file or a page has one, and a query of anyone's choosing would file
    one copy per spelling (and push the answers that matter out). Nor a path escaping
    what needs no escape."""
    assert state.lane is not None
    if scope.get("query_string"):
        return
    target = scope.get("raw_path") or scope["path"].encode()
    if not escapes_only_what_it_must(target):
        return  # another spelling of a path: likewise
    state.lane.offer(
        target, scope["headers"], "GET", response.status, response.headers, response.body, ticket
    )


def _expects_continue(scope: Scope) -> bool:
    return any(
        name == b"expect" and value.strip().lower() == b"100-continue"
        for name, value in scope.get("headers", ())
    )


def _unknown(repository: str, state: Engine) -> NotFound:
    known = ", ".join(f"/{name}/" for name in state.adapters) or "none"
    return NotFound(f"no repository named {repository!r}; configured: {known}")


def _landing(state: Engine) -> ASGIResponse:
    lines = ["artifact proxy", ""]
    for repo in state.settings.repositories:
        line = f"/{repo.name}/  format={repo.format}"
        if repo.proxies:
            upstreams = ", ".join(repo.upstreams) or "NOT SET: set " + repo.upstream_setting
            line += f"  upstream={upstreams}"
        lines.append(line)
    lines += ["", "/healthz  /readyz  /metrics"]
    return responses.error(200, "\n".join(lines))


async def healthz(request: StarletteRequest) -> Response:
    return PlainTextResponse("ok\n")


async def readyz(request: StarletteRequest) -> Response:
    """Ready to serve? ``/readyz`` checks the database and the storage too: for
    operators and monitoring. ``/readyz?scope=local`` checks only this process (started,
    not shutting down): for load balancers and Kubernetes readiness. The database and
    the shared volume are the same for every replica, so a check on them takes every
    replica out of rotation at once, also the cached hits they could still serve."""
    state: Engine = request.state.proxy
    scope = request.query_params.get("scope", "all")
    if scope not in ("all", "local"):
        return PlainTextResponse(
            f"unknown readiness scope {scope!r}; use /readyz or /readyz?scope=local\n",
            status_code=400,
        )
    if scope == "local":
        if state.tasks.closing:
            return PlainTextResponse("not ready: shutting down\n", status_code=503)
        return PlainTextResponse("ready (this process; /readyz checks its dependencies)\n")
    problems = []
    try:
        async with asyncio.timeout(READY_CHECK_TIMEOUT_S):
            await state.catalog.ping()
    except (CatalogError, TimeoutError) as exc:
        problems.append(f"catalog: {exc or 'timed out'}")
    problems += await state.storage.problems(state.settings.storage.min_free)
    if state.tasks.closing:
        problems.append("shutting down")
    # An upstream that is down does not make us unready (cached files and stale pages
    # are served), but the operator reads here which one it is.
    outages = "".join(f"{line}\n" for line in state.upstreams.outages())
    if problems:
        body = "not ready: " + "; ".join(problems) + "\n" + outages
        return PlainTextResponse(redact(body), status_code=503)
    return PlainTextResponse(redact("ready\n" + outages))


async def metrics_endpoint(request: StarletteRequest) -> Response:
    lane = request.state.proxy.lane
    if lane is not None:
        lane.flush()  # its hits' counts, added every second, are current when read
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)

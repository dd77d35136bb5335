"""The web console under ``/ui/``: server-rendered pages (Jinja2 templates in
``admin/templates/``), plain links and forms, no JavaScript (docs/architecture.md,
"Operating: console, API and logs").

Every page is a GET that changes nothing; every change is a POST form carrying the
user's CSRF token, answered with a redirect to the page that shows its effect
(post/redirect/get). The pages read what ``admin/overview.py`` gathers, as the API does.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin.auth import CSRF_FIELD, Caller, Refused, check_csrf, notice_signature
from proxy.admin.install import client_guides
from proxy.admin.overview import PAGE_SIZE_DEFAULT
from proxy.admin.requests import (
    Failure,
    admin_state,
    caller_of,
    mirror_request,
    number_in,
    read_body,
    root_of,
)
from proxy.exceptions import Conflict, NotFound, ProxyError
from proxy.redaction import redact
from proxy.units import human_size

log = logging.getLogger("proxy.admin")

TEMPLATES = Path(__file__).resolve().parent / "templates"
FORM_MAX_BYTES = 1024 * 1024
RUNNING_REFRESH_S = 2  # a running mirror run's page reloads itself (no JavaScript)

Page = Callable[[Request, Caller], Awaitable[Response]]


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def _ago(ms: int | None, now_ms: int | None = None) -> str:
    if ms is None:
        return "never"
    seconds = max(0, int(((now_ms or time.time() * 1000) - ms) / 1000))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def _size(n: int | None) -> str:
    return "-" if n is None else human_size(int(n))


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.1f}%"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


ENVIRONMENT = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,  # every value is escaped: keys and purls come from anyone
    undefined=jinja2.StrictUndefined,
)
ENVIRONMENT.filters.update(
    when=_when, ago=_ago, size=_size, percent=_percent, duration=_duration, redact=redact,
    path=lambda text: quote(text, safe="/"), segment=lambda text: quote(text, safe=""),
)  # fmt: skip


def render(
    request: Request, caller: Caller, template: str, code: int = 200, **values: Any
) -> Response:
    page = ENVIRONMENT.get_template(template).render(
        caller=caller,
        root=root_of(request),
        csrf_field=CSRF_FIELD,
        request_path=request.url.path,
        notice=_notice(request, caller),
        **values,
    )
    return HTMLResponse(
        page,
        code,
        headers={
            "cache-control": "no-store",
            # No script, no frame, no form posting elsewhere: the console needs none.
            "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; "
            "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'",
            "x-content-type-options": "nosniff",
            "referrer-policy": "same-origin",
        },
    )


def to_index(request: Request) -> Response:
    return RedirectResponse(f"{root_of(request)}/ui/", 308)


def _notice(request: Request, caller: Caller) -> str | None:
    """The notice a form's redirect carries, if the console wrote it for this caller."""
    notice = request.query_params.get("notice")
    given = request.query_params.get("notice_sig", "")
    if not notice or not caller.can_write:
        return None
    if not hmac.compare_digest(given, notice_signature(caller, notice)):
        return None
    return notice


def page(handler: Page) -> Callable[[Request], Awaitable[Response]]:
    """The checks every page shares: the caller (and on POST its CSRF token), and
    errors as a page with the message."""

    async def run(request: Request) -> Response:
        caller = Caller(None, "anonymous")
        try:
            caller = caller_of(request)
            return await handler(request, caller)
        except Refused as exc:
            response = render(
                request, caller, "error.html", exc.status, status=exc.status, message=exc.message
            )
            response.headers.update(exc.headers)
            return response
        except ProxyError as exc:
            failure = Failure.of(exc)
            response = render(
                request, caller, "error.html", failure.status,
                status=failure.status, message=failure.message,
            )  # fmt: skip
            response.headers.update(failure.headers)
            return response

    return run


async def form_of(request: Request, caller: Caller) -> dict[str, str]:
    """A POSTed form's fields (urlencoded), after its CSRF token is checked."""
    body = await read_body(request, FORM_MAX_BYTES)
    fields = {k: v[-1] for k, v in parse_qs(body.decode("utf-8", "replace")).items()}
    check_csrf(caller, fields.get(CSRF_FIELD))
    return fields


def back(
    request: Request, path: str, caller: Caller, notice: str | None = None, **query: str
) -> Response:
    if notice:
        query["notice"] = notice
        query["notice_sig"] = notice_signature(caller, notice)
    suffix = f"?{urlencode(query)}" if query else ""
    return RedirectResponse(f"{root_of(request)}/ui{path}{suffix}", status_code=303)


# -- pages ----------------------------------------------------------------------------------


async def dashboard(request: Request, caller: Caller) -> Response:
    overview = admin_state(request).overview
    stats = await overview.stats()
    storage = await overview.storage()
    replicas = await overview.replicas()
    upstreams = await overview.upstream_health()
    in_flight = await overview.in_flight()
    jobs = await overview.jobs()
    healthy = all(r["alive"] for r in replicas) and storage["database"].get("ok", False)
    healthy = healthy and storage["storage"].get("ok", False)
    return render(
        request, caller, "dashboard.html",
        repositories=stats["repositories"], database=storage["database"],
        storage=storage["storage"], replicas=replicas, upstreams=upstreams,
        in_flight=in_flight[:10], in_flight_total=len(in_flight),
        failures=jobs["failures"][:5], mirror_runs=jobs["mirror_runs"][:5],
        healthy=healthy,
    )  # fmt: skip


async def in_flight(request: Request, caller: Caller) -> Response:
    overview = admin_state(request).overview
    return render(request, caller, "in_flight.html", in_flight=await overview.in_flight())


async def jobs(request: Request, caller: Caller) -> Response:
    state = admin_state(request)
    found = await state.overview.jobs()
    mirrorable = list(state.engine.mirrors.sources)
    return render(request, caller, "jobs.html", mirrorable=mirrorable, **found)


async def mirror_run(request: Request, caller: Caller) -> Response:
    run = await admin_state(request).overview.mirror_run(_run_id(request))
    return render(
        request, caller, "mirror_run.html", run=run,
        refresh_s=RUNNING_REFRESH_S if run["state"] == "running" else None,
    )  # fmt: skip


def _run_id(request: Request) -> int:
    text = request.path_params["run_id"]
    run_id = number_in(text)
    if run_id is None:
        raise NotFound(f"{text!r} is not a mirror run id")
    return run_id


async def start_mirror_run(request: Request, caller: Caller) -> Response:
    state = admin_state(request)
    fields = await form_of(request, caller)
    purls = [line.strip() for line in fields.get("purls", "").split() if line.strip()]
    asked = await mirror_request(
        state.engine, purls, None, fields.get("versions") or None, fields.get("repository") or None
    )
    run_id = await state.engine.mirrors.launch(
        "console", asked.purls, asked.versions, asked.repository
    )
    log.info("mirror run %d started from the console (by %s)", run_id, caller.name)
    return back(request, f"/mirror-runs/{run_id}", caller, f"mirror run {run_id} started")


async def cancel_mirror_run(request: Request, caller: Caller) -> Response:
    state = admin_state(request)
    await form_of(request, caller)
    run_id = _run_id(request)
    if not await state.engine.catalog.cancel_mirror_run(run_id):
        raise Conflict(f"mirror run {run_id} is not running")
    log.info("mirror run %d: cancellation asked from the console (by %s)", run_id, caller.name)
    return back(request, f"/mirror-runs/{run_id}", caller, f"cancellation of run {run_id} asked")


async def browse(request: Request, caller: Caller) -> Response:
    state = admin_state(request)
    overview = state.overview
    repositories = (await overview.stats())["repositories"]
    name = request.query_params.get("repository") or (
        repositories[0]["name"] if repositories else None
    )
    q = request.query_params.get("q", "").strip()
    view = request.query_params.get("view", "")
    after = request.query_params.get("after")
    listing: dict[str, Any] | None = None
    by_package = False
    if name is not None:
        name = overview.repository(name)
        by_package = name in state.engine.package_of and view != "entries"
        if by_package:
            listing = await overview.packages(name, q, after, PAGE_SIZE_DEFAULT)
        else:
            listing = await overview.entries(name, q, after, PAGE_SIZE_DEFAULT)
    return render(
        request, caller, "browse.html", repositories=repositories, repository=name, q=q,
        view=view, listing=listing, by_package=by_package,
        groups=name in state.engine.package_of if name else False,
    )  # fmt: skip


async def package(request: Request, caller: Caller) -> Response:
    overview = admin_state(request).overview
    repository = overview.repository(request.path_params["repository"])
    found = await overview.package(repository, request.path_params["package"])
    return render(request, caller, "package.html", package=found)


async def entry(request: Request, caller: Caller) -> Response:
    overview = admin_state(request).overview
    repository = overview.repository(request.path_params["repository"])
    found = await overview.entry(repository, request.path_params["path"])
    return render(request, caller, "entry.html", entry=found)


async def purge_package(request: Request, caller: Caller) -> Response:
    overview = admin_state(request).overview
    fields = await form_of(request, caller)
    repository = overview.repository(fields.get("repository"))
    name = fields.get("package", "")
    result = await overview.purge_package(repository, name)
    log.info(
        "purged package %s/%s from the console: %d entries (by %s)",
        repository, name, result["deleted"], caller.name,
    )  # fmt: skip
    return back(
        request,
        "/browse",
        caller,
        f"purged {name}: {result['deleted']} entries ({human_size(result['bytes'])})",
        repository=repository,
    )


async def purge_entry(request: Request, caller: Caller) -> Response:
    overview = admin_state(request).overview
    fields = await form_of(request, caller)
    repository = overview.repository(fields.get("repository"))
    key = fields.get("key", "")
    await overview.purge_entry(repository, key)
    log.info("purged entry %s/%s from the console (by %s)", repository, key, caller.name)
    return back(request, "/browse", caller, f"purged {key}", repository=repository, view="entries")


async def install(request: Request, caller: Caller) -> Response:
    state = admin_state(request)
    # The address clients use: behind a load balancer, server.public_url (the Host a
    # replica sees is the balancer's business).
    base = state.engine.settings.public_url or (
        f"{request.url.scheme}://{request.headers.get('host', request.url.netloc)}"
    )
    guides = client_guides(state.engine.settings, base)
    return render(request, caller, "install.html", base=base, guides=guides)


async def not_found(request: Request, caller: Caller) -> Response:
    raise NotFound(f"no console page {request.url.path}")


def routes() -> list[BaseRoute]:
    """Mounted at ``/ui``."""
    return [
        Route("/", page(dashboard), methods=["GET", "HEAD"]),
        Route("/in-flight", page(in_flight), methods=["GET", "HEAD"]),
        Route("/jobs", page(jobs), methods=["GET", "HEAD"]),
        Route("/mirror-runs", page(start_mirror_run), methods=["POST"]),
        Route("/mirror-runs/{run_id}", page(mirror_run), methods=["GET", "HEAD"]),
        Route("/mirror-runs/{run_id}/cancel", page(cancel_mirror_run), methods=["POST"]),
        Route("/browse", page(browse), methods=["GET", "HEAD"]),
        Route("/packages/{repository}/{package:path}", page(package), methods=["GET", "HEAD"]),
        Route("/entries/{repository}/{path:path}", page(entry), methods=["GET", "HEAD"]),
        Route("/purge-package", page(purge_package), methods=["POST"]),
        Route("/purge-entry", page(purge_entry), methods=["POST"]),
        Route("/install", page(install), methods=["GET", "HEAD"]),
        Route("/{rest:path}", page(not_found)),
    ]

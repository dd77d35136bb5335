"""The admin API under ``/api/v1/``: JSON, described by ``/api/v1/openapi.json``
(``admin/openapi.py``), documented in the README (docs/architecture.md, "Operating:
console, API and logs").

Reads need read access (a user, or ``admin.anonymous = "read"``); writes need a user,
come from our own origin or no browser at all, and, with Basic credentials, must be
JSON (``admin/auth.py``). Errors are ``{"error": "..."}`` with the status.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin.auth import Caller, Refused
from proxy.admin.openapi import openapi_document
from proxy.admin.overview import PAGE_SIZE_DEFAULT, PAGE_SIZE_MAX
from proxy.admin.requests import (
    Failure,
    admin_state,
    caller_of,
    mirror_request,
    number_in,
    read_body,
    root_of,
)
from proxy.exceptions import BadRequest, Conflict, NotFound, ProxyError, UnsupportedMediaType
from proxy.redaction import redact
from proxy.runtime.blocking import run_blocking

log = logging.getLogger("proxy.admin")

Endpoint = Callable[[Request, Caller], Awaitable[Any]]
INLINE_JSON_BYTES = 64 * 1024  # bodies larger than this are parsed in the I/O pool


def answer(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(data, status, {"cache-control": "no-store", **(headers or {})})


def problem(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return answer({"error": redact(message)}, status, headers)


def endpoint(handler: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """The checks every endpoint shares: the caller, and errors as JSON."""

    async def run(request: Request) -> Response:
        try:
            caller = caller_of(request)
            if (
                request.method == "POST"
                and caller.scheme == "basic"
                and request.headers.get("content-type", "").split(";")[0].strip().lower()
                != "application/json"
            ):
                # A cross-site form can send Basic credentials, but not JSON.
                raise UnsupportedMediaType("send the body as application/json")
            result = await handler(request, caller)
        except Refused as exc:
            return problem(exc.status, exc.message, exc.headers)
        except ProxyError as exc:
            failure = Failure.of(exc)
            return problem(failure.status, failure.message, failure.headers)
        if isinstance(result, Response):
            return result
        return answer(result)

    return run


def _limit(request: Request) -> int:
    text = request.query_params.get("limit", str(PAGE_SIZE_DEFAULT))
    limit = number_in(text, PAGE_SIZE_MAX)
    if limit is None or limit < 1:
        raise BadRequest(f"limit={text!r}: give a number from 1 to {PAGE_SIZE_MAX}")
    return limit


async def stats(request: Request, caller: Caller) -> Any:
    overview = admin_state(request).overview
    return {
        **(await overview.stats()),
        **(await overview.storage()),
        "replicas": await overview.replicas(),
        "upstreams": await overview.upstream_health(),
    }


async def replicas(request: Request, caller: Caller) -> Any:
    return {"replicas": await admin_state(request).overview.replicas()}


async def in_flight(request: Request, caller: Caller) -> Any:
    return {"in_flight": await admin_state(request).overview.in_flight()}


async def jobs(request: Request, caller: Caller) -> Any:
    return await admin_state(request).overview.jobs()


async def entries(request: Request, caller: Caller) -> Any:
    overview = admin_state(request).overview
    repository = overview.repository(request.query_params.get("repository"))
    q = request.query_params.get("q", "")
    return await overview.entries(repository, q, request.query_params.get("after"), _limit(request))


async def entry(request: Request, caller: Caller) -> Any:
    overview = admin_state(request).overview
    repository = overview.repository(request.path_params["repository"])
    return await overview.entry(repository, request.path_params["path"])


async def delete_entry(request: Request, caller: Caller) -> Any:
    overview = admin_state(request).overview
    repository = overview.repository(request.path_params["repository"])
    result = await overview.purge_entry(repository, request.path_params["path"])
    log.info("purged entry %s/%s (by %s)", repository, request.path_params["path"], caller.name)
    return result


async def packages(request: Request, caller: Caller) -> Any:
    overview = admin_state(request).overview
    repository = overview.repository(request.query_params.get("repository"))
    q = request.query_params.get("q", "")
    return await overview.packages(
        repository, q, request.query_params.get("after"), _limit(request)
    )


async def package(request: Request, caller: Caller) -> Any:
    overview = admin_state(request).overview
    repository = overview.repository(request.path_params["repository"])
    return await overview.package(repository, request.path_params["package"])


async def delete_package(request: Request, caller: Caller) -> Any:
    overview = admin_state(request).overview
    repository = overview.repository(request.path_params["repository"])
    name = request.path_params["package"]
    result = await overview.purge_package(repository, name)
    log.info(
        "purged package %s/%s: %d entries (by %s)", repository, name, result["deleted"], caller.name
    )
    return result


async def start_mirror_run(request: Request, caller: Caller) -> Any:
    state = admin_state(request)
    body = await read_body(request)
    try:
        # An SBOM can be megabytes: parsed off the event loop.
        document = (
            await run_blocking(json.loads, body)
            if len(body) > INLINE_JSON_BYTES
            else json.loads(body)
        )
    except (ValueError, RecursionError):
        raise BadRequest(
            'the body is not JSON; send e.g. {"purls": ["pkg:pypi/requests"]}'
        ) from None
    if not isinstance(document, dict):
        raise BadRequest('the body must be an object: {"purls": [...]} or {"sbom": {...}}')
    unknown = set(document) - {"purls", "sbom", "versions", "repository"}
    if unknown:
        raise BadRequest(
            f"unknown fields {', '.join(sorted(unknown))}; "
            "expected purls, sbom, versions, repository"
        )
    asked = await mirror_request(
        state.engine,
        document.get("purls"),
        document.get("sbom"),
        document.get("versions"),
        document.get("repository"),
    )
    run_id = await state.engine.mirrors.launch("api", asked.purls, asked.versions, asked.repository)
    log.info("mirror run %d started: %d purls (by %s)", run_id, len(asked.purls), caller.name)
    location = f"{root_of(request)}/api/v1/mirror-runs/{run_id}"
    return answer({"id": run_id, "state": "running", "url": location}, 202, {"location": location})


def _run_id(request: Request) -> int:
    text = request.path_params["run_id"]
    run_id = number_in(text)
    if run_id is None:
        raise BadRequest(f"{text!r} is not a mirror run id")
    return run_id


async def mirror_run(request: Request, caller: Caller) -> Any:
    return await admin_state(request).overview.mirror_run(_run_id(request))


async def cancel_mirror_run(request: Request, caller: Caller) -> Any:
    state = admin_state(request)
    run_id = _run_id(request)
    run = await state.overview.mirror_run(run_id)  # NotFound for an unknown id
    if run["state"] != "running":
        raise Conflict(f"mirror run {run_id} is {run['state']}, not running")
    await state.engine.catalog.cancel_mirror_run(run_id)
    log.info("mirror run %d: cancellation asked (by %s)", run_id, caller.name)
    return answer({**run, "cancel_requested": True}, 202)


async def openapi(request: Request, caller: Caller) -> Any:
    return openapi_document()


def routes() -> list[BaseRoute]:
    """Mounted at ``/api``."""
    return [
        Route("/v1/openapi.json", endpoint(openapi), methods=["GET"]),
        Route("/v1/stats", endpoint(stats), methods=["GET"]),
        Route("/v1/replicas", endpoint(replicas), methods=["GET"]),
        Route("/v1/in-flight", endpoint(in_flight), methods=["GET"]),
        Route("/v1/jobs", endpoint(jobs), methods=["GET"]),
        Route("/v1/entries", endpoint(entries), methods=["GET"]),
        Route("/v1/entries/{repository}/{path:path}", endpoint(entry), methods=["GET"]),
        Route("/v1/entries/{repository}/{path:path}", endpoint(delete_entry), methods=["DELETE"]),
        Route("/v1/packages", endpoint(packages), methods=["GET"]),
        Route("/v1/packages/{repository}/{package:path}", endpoint(package), methods=["GET"]),
        Route(
            "/v1/packages/{repository}/{package:path}", endpoint(delete_package), methods=["DELETE"]
        ),
        Route("/v1/mirror-runs", endpoint(start_mirror_run), methods=["POST"]),
        Route("/v1/mirror-runs/{run_id}", endpoint(mirror_run), methods=["GET"]),
        Route("/v1/mirror-runs/{run_id}", endpoint(cancel_mirror_run), methods=["DELETE"]),
        Route("/{rest:path}", endpoint(not_found)),
    ]


async def not_found(request: Request, caller: Caller) -> Any:
    raise NotFound(f"no API endpoint {request.method} {request.url.path}; see /api/v1/openapi.json")

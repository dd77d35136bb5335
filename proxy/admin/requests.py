"""What the console and the API both do with a request: find the engine's admin state,
check the caller, read a bounded body, and start a mirror run from what was asked."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request

from proxy.admin.auth import AdminAuth, Caller
from proxy.admin.overview import Overview
from proxy.config.settings import MIRROR_VERSIONS, Settings
from proxy.engine import Engine
from proxy.exceptions import BadRequest, PayloadTooLarge, ProxyError
from proxy.http.errors import rule_for
from proxy.mirror.purls import parse_purl
from proxy.mirror.sbom import purls_in_sbom
from proxy.runtime.blocking import run_blocking

log = logging.getLogger("proxy.admin")

BODY_MAX_BYTES = 16 * 1024 * 1024  # an SBOM of a large product fits
MIRROR_PURLS_MAX = 100_000
ID_MAX = 2**63 - 1  # ids are 64-bit in both backends


@dataclass
class AdminState:
    """What the console and the API need, built once in the lifespan."""

    engine: Engine
    overview: Overview
    auth: AdminAuth

    @classmethod
    def of(cls, engine: Engine, settings: Settings) -> AdminState:
        return cls(engine, Overview(engine), AdminAuth(settings))


def admin_state(request: Request) -> AdminState:
    state: AdminState = request.state.admin
    return state


def caller_of(request: Request) -> Caller:
    return admin_state(request).auth.caller(request)


def root_of(request: Request) -> str:
    """The path the browser sees before ``/ui/`` and ``/api/``: ``server.public_url``'s
    (a balancer that strips ``/artifacts`` before passing requests on), else none."""
    public_url = admin_state(request).engine.settings.public_url
    return urlsplit(public_url).path.rstrip("/") if public_url else ""


async def read_body(request: Request, limit: int = BODY_MAX_BYTES) -> bytes:
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def number_in(text: str, maximum: int = ID_MAX) -> int | None:
    """``text`` as a whole number from 0 to ``maximum``, or None: ASCII digits only
    (``str.isdigit`` also takes "²", which ``int`` refuses, and "٣", which it reads)."""
    if not text.isascii() or not text.isdigit() or len(text) > len(str(maximum)):
        return None
    value = int(text)
    return value if value <= maximum else None


@dataclass(frozen=True)
class Failure:
    """What the console or the API answers for an error: status, message, headers,
    from the one error table (``http/errors.py``), logged as it says."""

    status: int
    message: str
    headers: dict[str, str]

    @classmethod
    def of(cls, exc: ProxyError) -> Failure:
        rule = rule_for(exc)
        if rule.level is not None:
            log.log(rule.level, "admin: %s: %s", type(exc).__name__, exc)
        if rule.public is None:
            message = str(exc)
        else:
            message = rule.public if isinstance(rule.public, str) else rule.public(exc)
        headers = dict(rule.headers(exc)) if rule.headers else {}
        return cls(rule.status, message, headers)


@dataclass(frozen=True)
class MirrorRequest:
    purls: list[str]
    versions: str
    repository: str | None


async def mirror_request(
    engine: Engine, purls: Any, sbom: Any, versions: Any, repository: Any
) -> MirrorRequest:
    """A mirror run's request, validated: every purl parsed, the SBOM's read, the types
    of the purls given mirrored by some repository here (else ``BadRequest`` naming
    those that are)."""
    if purls is None:
        purls = []
    if not isinstance(purls, list) or not all(isinstance(p, str) for p in purls):
        raise BadRequest('purls must be a list of package URLs, e.g. ["pkg:pypi/requests"]')
    # Thousands of purls take a while to parse: off the event loop.
    found = await run_blocking(_canonical, purls) if len(purls) > 100 else _canonical(purls)
    given = list(found)
    if sbom is not None:
        if not isinstance(sbom, dict):
            raise BadRequest("sbom must be a CycloneDX or SPDX JSON document (an object)")
        try:
            found += await run_blocking(lambda: purls_in_sbom(json.dumps(sbom).encode()))
        except ValueError as exc:
            raise BadRequest(f"sbom: {exc}") from None
    if not found:
        raise BadRequest('nothing to mirror: give "purls" or an "sbom" that lists some')
    if len(found) > MIRROR_PURLS_MAX:
        raise BadRequest(f"{len(found)} purls; at most {MIRROR_PURLS_MAX} per run")
    versions = versions or "latest"
    if versions not in MIRROR_VERSIONS:
        raise BadRequest(f"versions must be one of {', '.join(MIRROR_VERSIONS)}")
    if repository is not None and (
        not isinstance(repository, str) or repository not in engine.mirrors.sources
    ):
        choices = ", ".join(engine.mirrors.sources) or "none is configured"
        raise BadRequest(f"repository {repository!r} is not a repository that mirrors ({choices})")
    # A purl given by name must be mirrorable; an SBOM lists every ecosystem of a
    # product, and its purls of other types are skipped and counted by the run.
    unsupported = await run_blocking(engine.mirrors.unsupported, given, repository)
    if unsupported:
        raise BadRequest("; ".join(unsupported[:5]))
    return MirrorRequest(list(dict.fromkeys(found)), versions, repository)


def _canonical(purls: list[str]) -> list[str]:
    found = []
    for text in purls:
        try:
            found.append(parse_purl(text).purl)
        except ValueError as exc:
            raise BadRequest(f"purls: {exc}") from None
    return found

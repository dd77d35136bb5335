"""The one error table: which answer each exception becomes.

Formats and the engine only raise; ``answer(exc)`` decides the status, the headers
(Retry-After, Allow, a challenge) and whether and how loudly the failure is logged,
from the first class along ``type(exc).__mro__`` that has a rule (starlette's
``_exception_handler.py`` does the same lookup). A subclass without a rule of its own
answers as its parent; anything unforeseen is a 500 with its class named, logged with
its traceback, never a traceback to the client (docs/architecture.md, "Errors").
"""

from __future__ import annotations

import http
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.exceptions import (
    AddressRefused,
    BadRequest,
    BodyChanged,
    CatalogError,
    ClientError,
    Conflict,
    ContentMismatch,
    DigestMismatch,
    FetchError,
    Forbidden,
    HeadersTooLarge,
    MethodNotAllowed,
    NotAcceptable,
    NotConfigured,
    NotFound,
    ParseFailed,
    PayloadTooLarge,
    ProxyError,
    ReleaseWithheld,
    RequestTimeout,
    RetryLater,
    ShuttingDown,
    StorageError,
    StorageFull,
    StorageUnavailable,
    TooManyRequests,
    TransferCut,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
    UpstreamBusy,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
    UriTooLong,
)
from proxy.http.responses import NEVER_STORE, BodyResponse, error
from proxy.http.semantics import retry_after_header
from proxy.redaction import redact

log = logging.getLogger("proxy.errors")


@dataclass(frozen=True)
class Rule:
    status: int
    # Logged here at this level (None: not logged here; the miss path logs upstream
    # failures where they happen, with the key).
    level: int | None = None
    # What clients are told instead of the exception's text (internals stay in the log).
    public: str | Callable[[BaseException], str] | None = None
    headers: Callable[[Any], Mapping[str, str]] | None = None
    traceback: bool = False  # log the traceback too: a bug of ours


def _retry_after(exc: Any) -> Mapping[str, str]:
    """Retry-After: the wait the failure stated, else the default (whole seconds, within
    sane bounds: ``semantics.retry_after_header``)."""
    return {"retry-after": retry_after_header(getattr(exc, "retry_after_s", None))}


def _allow(exc: MethodNotAllowed) -> Mapping[str, str]:
    return {"allow": ", ".join(exc.allowed)}


def _challenge(exc: Unauthorized) -> Mapping[str, str]:
    return {"www-authenticate": exc.challenge} if exc.challenge else {}


def _internal(exc: BaseException) -> str:
    return f"internal error: {type(exc).__name__}"


RULES: dict[type[BaseException], Rule] = {
    Exception: Rule(500, logging.ERROR, public=_internal, traceback=True),
    ProxyError: Rule(500, logging.ERROR, public=_internal),
    # The request is bad.
    ClientError: Rule(400),
    BadRequest: Rule(400),
    Unauthorized: Rule(401, headers=_challenge),
    Forbidden: Rule(403),
    NotFound: Rule(404),
    MethodNotAllowed: Rule(405, headers=_allow),
    NotAcceptable: Rule(406, headers=lambda _exc: {"vary": "Accept"}),
    RequestTimeout: Rule(408),
    Conflict: Rule(409),
    PayloadTooLarge: Rule(413),
    UnsupportedMediaType: Rule(415),
    UriTooLong: Rule(414),
    HeadersTooLarge: Rule(431),
    TooManyRequests: Rule(429, headers=_retry_after),
    # We cannot answer now.
    Unavailable: Rule(503, headers=_retry_after),
    NotConfigured: Rule(503, headers=_retry_after),
    ShuttingDown: Rule(503, headers=_retry_after),
    CatalogError: Rule(
        503,
        logging.ERROR,
        public="the cache database is unavailable; try again",
        headers=_retry_after,
    ),
    StorageError: Rule(
        503,
        logging.ERROR,
        public="the cache storage is unavailable; try again",
        headers=_retry_after,
    ),
    StorageFull: Rule(
        503,  # logged by the miss path, with the key
        public=(
            "the cache storage is full: files it does not hold yet are not fetched until "
            "space is freed (cached files are still served); try again later"
        ),
        headers=_retry_after,
    ),
    StorageUnavailable: Rule(
        503,
        logging.ERROR,
        public="the cache's object storage is unavailable (unreachable or throttling); try again",
        headers=_retry_after,
    ),
    # Getting the body failed (and no stale copy could answer).
    FetchError: Rule(502),
    UpstreamError: Rule(502),
    UpstreamTimeout: Rule(504),
    UpstreamUnavailable: Rule(502),
    UpstreamBusy: Rule(503, headers=_retry_after),
    AddressRefused: Rule(502),
    DigestMismatch: Rule(502),
    ContentMismatch: Rule(502),
    RetryLater: Rule(503, headers=_retry_after),
    ParseFailed: Rule(502),
    TransferCut: Rule(502),
    BodyChanged: Rule(502),
}


def rule_for(exc: BaseException) -> Rule:
    """The rule of the first class along ``type(exc).__mro__`` that has one."""
    for cls in type(exc).__mro__:
        rule = RULES.get(cls)
        if rule is not None:
            return rule
    return RULES[Exception]  # a BaseException that is no Exception (never raised here)


PROBLEM_JSON = "application/problem+json"


def wants_problem(accept: str | None) -> bool:
    """Does the client ask for RFC 9457 problem documents (``Accept:
    application/problem+json``, with a q-value above 0)?"""
    if not accept or PROBLEM_JSON not in accept:
        return False
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if media.lower() != PROBLEM_JSON:
            continue
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


def answer(
    exc: BaseException, repository: str = "-", as_json: bool = False, accept: str | None = None
) -> BodyResponse:
    """The answer ``exc`` becomes, logged as its rule says: an RFC 9457 problem document
    when the client's ``Accept`` asks for one; else ``{"error": message}`` if
    ``as_json`` (the repository's format says its clients read that), else plain text."""
    rule = rule_for(exc)
    if rule.level is not None:
        log.log(
            rule.level,
            "repository=%s %s: %s",
            repository,
            type(exc).__name__,
            exc,
            exc_info=exc if rule.traceback else None,
        )
    if rule.public is None:
        message = str(exc)
    else:
        message = rule.public if isinstance(rule.public, str) else rule.public(exc)
    headers = rule.headers(exc) if rule.headers else None
    if wants_problem(accept):
        return problem(rule.status, message, exc, headers)
    return error(rule.status, message, headers, as_json)


def problem(
    status: int, message: str, exc: BaseException, extra: Mapping[str, str] | None
) -> BodyResponse:
    """An RFC 9457 problem document: the facts a ``ReleaseWithheld`` carries, or the
    status and the message for any other error; redacted like every answer."""
    if isinstance(exc, ReleaseWithheld):
        document: dict[str, object] = dict(exc.problem)
    else:
        document = {
            "type": "about:blank",
            "title": http.HTTPStatus(status).phrase,
            "status": status,
            "detail": message,
        }
    body = redact(json.dumps(document, ensure_ascii=True)).encode()
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"cache-control", NEVER_STORE),
        (b"content-length", str(len(body)).encode()),
    ]
    for name, value in (extra or {}).items():
        headers.append((name.lower().encode(), value.encode("latin-1")))
    return BodyResponse(status, headers, body)

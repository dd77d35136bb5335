"""Gradle HTTP build cache: ``GET|HEAD|PUT /{repo}/{key}``, opaque bodies.

PUT checks, in this order and before reading a single body byte: credentials (401
with a Basic challenge, or 403 for a read-only user), then the declared
Content-Length against ``max_entry_size`` (413, so a client sending
``Expect: 100-continue`` never sends the body). A body without Content-Length is cut
off with 413 at the limit and nothing is stored. A 2xx is sent only once the entry is
durable: the file fsynced and the catalog row committed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import AsyncIterator

from proxy import metrics, responses
from proxy.cache import Cache
from proxy.config import RepositorySettings
from proxy.exceptions import BadRequest, Forbidden, NotFound, PayloadTooLarge, Unauthorized
from proxy.formats import ASGIResponse, Request

CONTENT_TYPE = "application/vnd.gradle.build-cache-artifact.v2"
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,255}$")
_ROLE_RANK = {"none": 0, "read": 1, "write": 2}


class BuildCacheRepository:
    def __init__(self, settings: RepositorySettings, cache: Cache) -> None:
        self.settings = settings
        self.name = settings.name
        self.cache = cache
        self.users = {user.name: user for user in settings.users}
        self.challenge = {"www-authenticate": f'Basic realm="{self.name}", charset="UTF-8"'}

    async def handle(self, request: Request) -> ASGIResponse:
        if request.method not in ("GET", "HEAD", "PUT"):
            return responses.error(
                405,
                f"{request.method} is not allowed; use GET, HEAD or PUT",
                {"allow": "GET, HEAD, PUT"},
            )
        key = request.path
        if not _KEY_RE.match(key):
            raise BadRequest(
                f"{key!r} is not a build cache key: use letters, digits, '.', '_' and '-' "
                "(starting with a letter or digit), at most 256 characters"
            )
        try:
            self._authorize(request, "write" if request.method == "PUT" else "read")
        except Unauthorized as exc:
            if request.method == "PUT":
                metrics.BUILD_CACHE_WRITES.labels(self.name, "unauthorized").inc()
            return responses.error(401, str(exc), self.challenge)
        except Forbidden as exc:
            if request.method == "PUT":
                metrics.BUILD_CACHE_WRITES.labels(self.name, "forbidden").inc()
            return responses.error(403, str(exc))
        if request.method == "PUT":
            return await self._put(request, key)
        entry = await self.cache.lookup(self.name, key)
        if entry is None:
            raise NotFound(f"no build cache entry {key}")
        if request.method == "GET":
            # Only a read is a use; a HEAD probe must not keep an entry from eviction.
            self.cache.access.record(self.name, key)
        metrics.CACHE_HITS.labels(self.name, "gradle-build-cache", "hosted").inc()
        try:
            return await self.cache.render_entry(
                entry, request.method, request.headers, {"content-type": CONTENT_TYPE}
            )
        except FileNotFoundError:
            await self.cache.forget(entry)
            raise NotFound(f"no build cache entry {key}") from None

    def _authorize(self, request: Request, needed: str) -> None:
        header = request.headers.get("authorization")
        if header is None:
            if _ROLE_RANK[self.settings.anonymous] >= _ROLE_RANK[needed]:
                return
            raise Unauthorized(f"{needed} access to {self.name!r} needs credentials")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            raise Unauthorized("only Basic authentication is supported")
        try:
            user_name, sep, password = (
                base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
            )
        except (binascii.Error, ValueError):  # incl. UnicodeDecodeError, non-ASCII input
            raise Unauthorized("malformed Basic credentials") from None
        user = self.users.get(user_name)
        # Compare even for unknown users, so timing does not reveal which names exist.
        expected = user.password if user is not None else "\x00"
        if not sep or not hmac.compare_digest(password.encode(), expected.encode()) or user is None:
            raise Unauthorized("wrong user name or password")
        if _ROLE_RANK[user.role] < _ROLE_RANK[needed]:
            raise Forbidden(f"user {user_name!r} may only read from {self.name!r}")

    async def _put(self, request: Request, key: str) -> ASGIResponse:
        limit = self.settings.max_entry_size
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise BadRequest(f"Content-Length {declared!r} is not a number")
            if int(declared) > limit:
                metrics.BUILD_CACHE_WRITES.labels(self.name, "too_large").inc()
                # Decided before any body byte is read: with Expect: 100-continue the
                # client never sends it.
                return responses.error(
                    413, f"{key}: {declared} bytes is over this cache's {limit}-byte entry limit"
                )
        content_type = request.headers.get("content-type") or CONTENT_TYPE
        try:
            await self.cache.store_hosted(self.name, key, _body(request), limit, content_type)
        except PayloadTooLarge as exc:
            metrics.BUILD_CACHE_WRITES.labels(self.name, "too_large").inc()
            return responses.error(413, str(exc))
        metrics.BUILD_CACHE_WRITES.labels(self.name, "stored").inc()
        return responses.BodyResponse(201, [(b"content-length", b"0")], b"", self.name)


async def _body(request: Request) -> AsyncIterator[bytes]:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the client went away before the body was complete")
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return

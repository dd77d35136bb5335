"""Gradle HTTP build cache: ``GET|HEAD|PUT /{repo}/{key}``, opaque bodies.

PUT checks, in this order and before reading a single body byte: credentials (401
with a Basic challenge, or 403 for a read-only user), then the declared
Content-Length against ``max_entry_size`` (413, so a client sending
``Expect: 100-continue`` never sends the body). A body without Content-Length is cut
off with 413 at the limit and nothing is stored. A 2xx is sent only once the entry is
durable: the file fsynced and the catalog row committed.

A load balancer that answers ``Expect: 100-continue`` itself (nginx does) would let the
body come before our 401: it asks first, with a HEAD carrying ``X-Upload-Check`` (the
PUT's length), which gets the PUT's answer without a body (204 when it would be taken).
With no configuration, anonymous clients may write on loopback only. Wrong passwords
are logged and throttled: after a few, the (user, client) pair, or the client for
unknown names, gets 429 with Retry-After for a while (the engine's throttle).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from proxy.contract import (
    BadRequest,
    Choice,
    Forbidden,
    FormatPlugin,
    HostedContext,
    Hosting,
    MethodNotAllowed,
    OptionalSize,
    PayloadTooLarge,
    Reporter,
    RepositorySettings,
    Request,
    Response,
    Size,
    TooManyRequests,
    Unauthorized,
    option,
    toml_key,
)

log = logging.getLogger("proxy.formats.gradle_cache")

CONTENT_TYPE = "application/vnd.gradle.build-cache-artifact.v2"
# A HEAD with this header asks "would a PUT of this key be taken?" (its value: the PUT's
# Content-Length, maybe empty); the shipped nginx asks it before answering 100-continue.
UPLOAD_CHECK_HEADER = "x-upload-check"
DEFAULT_MAX_ENTRY_SIZE = 100 * 10**6
ROLES = ("read", "write")
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,255}$")
_ROLE_RANK = {"none": 0, "read": 1, "write": 2}


@dataclass(frozen=True)
class User:
    name: str
    password: str = field(repr=False)
    role: str


class Users:
    """``[repositories.<name>.users.<user>]`` tables: ``password`` and ``role``."""

    def parse(self, value: object, key: str, report: Reporter) -> tuple[User, ...] | None:
        if not isinstance(value, dict):
            report.error(key, "must be a table of user names")
            return None
        users: list[User] = []
        for user_name, raw_user in value.items():
            user_key = f"{key}.{user_name}"
            if not isinstance(raw_user, dict):
                report.error(user_key, "must be a table with password and role")
                continue
            if ":" in user_name or not user_name:
                report.error(user_key, "a user name must not be empty or contain ':'")
            for sub in raw_user:
                if sub not in ("password", "role"):
                    report.error(f"{user_key}.{sub}", "unknown key; expected password or role")
            password = raw_user.get("password")
            if isinstance(password, str):
                password = report.expand(password, f"{user_key}.password")
            if not isinstance(password, str) or not password:
                report.error(f"{user_key}.password", "is required and must not be empty")
                password = ""
            role = Choice(*ROLES).parse(raw_user.get("role", "read"), f"{user_key}.role", report)
            users.append(User(name=user_name, password=password, role=role or "read"))
        return tuple(users)

    def render(self, value: tuple[User, ...]) -> str:
        return "\n".join(
            f'users.{toml_key(user.name)} = {{ password = "***", role = "{user.role}" }}'
            for user in value
        )


@dataclass(frozen=True)
class BuildCacheOptions:
    max_entry_size: int = option(Size(), DEFAULT_MAX_ENTRY_SIZE)
    max_size: int | None = option(OptionalSize(), None)  # LRU sweep keeps the total under it
    anonymous: str = option(Choice("none", "read", "write"), "read")
    users: tuple[User, ...] = option(Users(), ())


def _validate(options: BuildCacheOptions) -> Iterator[tuple[str, str]]:
    if options.max_size is not None and options.max_size < options.max_entry_size:
        yield "max_size", "must not be smaller than max_entry_size"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _default_repository(listen_host: str) -> dict[str, str]:
    """With no configuration anyone may push on loopback (a developer's machine); on any
    other address (a container's 0.0.0.0) anonymous clients may only read: an open
    build cache lets anyone plant outputs that every build then uses."""
    anonymous = "write" if _is_loopback(listen_host) else "read"
    return {"name": "gradle-cache", "format": "gradle-build-cache", "anonymous": anonymous}


def _warnings(repo: RepositorySettings[BuildCacheOptions], listen_host: str) -> Iterator[str]:
    if _is_loopback(listen_host):
        return
    if repo.options.anonymous == "write":
        yield (
            f'repository {repo.name!r} lets anyone write (anonymous = "write") while listening '
            f"on {listen_host}: set repositories.{repo.name}.anonymous and add users"
        )
    elif not any(user.role == "write" for user in repo.options.users):
        yield (
            f"repository {repo.name!r} takes no uploads: nobody may write to it while the "
            f'proxy listens on {listen_host}; add a user with role = "write" '
            f"(repositories.{repo.name}.users) for the builds that push"
        )


class BuildCacheRepository:
    def __init__(self, settings: RepositorySettings[BuildCacheOptions], ctx: HostedContext) -> None:
        self.options = settings.options
        self.name = settings.name
        self.store = ctx.store
        self.responses = ctx.responses
        self.throttle = ctx.throttle
        self.users = {user.name: user for user in self.options.users}
        self.challenge = f'Basic realm="{self.name}", charset="UTF-8"'

    async def handle(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD", "PUT"):
            raise MethodNotAllowed(
                f"{request.method} is not allowed; use GET, HEAD or PUT",
                allowed=("GET", "HEAD", "PUT"),
            )
        key = request.path
        if not _KEY_RE.match(key):
            raise BadRequest(
                f"{key!r} is not a build cache key: use letters, digits, '.', '_' and '-' "
                "(starting with a letter or digit), at most 256 characters"
            )
        if request.method == "HEAD" and UPLOAD_CHECK_HEADER in request.headers:
            # A load balancer asks before it answers Expect: 100-continue itself
            # (deploy/nginx.conf): would a PUT of this key and length be taken?
            self._authorize(request, "write")
            self._check_length(key, request.headers[UPLOAD_CHECK_HEADER] or None)
            return self.responses.empty(204)
        self._authorize(request, "write" if request.method == "PUT" else "read")
        if request.method == "PUT":
            return await self._put(request, key)
        return await self.store.serve(key, request, CONTENT_TYPE)

    def _authorize(self, request: Request, needed: str) -> None:
        header = request.headers.get("authorization")
        if header is None:
            if _ROLE_RANK[self.options.anonymous] >= _ROLE_RANK[needed]:
                return
            raise Unauthorized(
                f"{needed} access to {self.name!r} needs credentials", self.challenge
            )
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            raise Unauthorized("only Basic authentication is supported", self.challenge)
        try:
            user_name, sep, password = (
                base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
            )
        except (binascii.Error, ValueError):  # incl. UnicodeDecodeError, non-ASCII input
            raise Unauthorized("malformed Basic credentials", self.challenge) from None
        user = self.users.get(user_name)
        # Wrong passwords lock the (user, client) pair: guessing a user's password from
        # one address stops there, and a stranger's guesses do not lock the user out
        # everywhere (its builds on other machines go on); unknown names lock the client.
        keys = (
            (f"user:{user_name}@{request.client}",)
            if user is not None
            else (f"client:{request.client}",)
        )
        wait_s = self.throttle.retry_after(*keys)
        if wait_s is not None:
            raise TooManyRequests(
                f"too many wrong passwords for {self.name!r}; try again later", wait_s
            )
        # Compare even for unknown users, so timing does not reveal which names exist.
        expected = user.password if user is not None else "\x00"
        if not sep or not hmac.compare_digest(password.encode(), expected.encode()) or user is None:
            self.throttle.failed(*keys)
            log.warning(
                "build cache login failed: repository=%s user=%s client=%s",
                self.name,
                user_name or "-",
                request.client or "-",
            )
            raise Unauthorized("wrong user name or password", self.challenge)
        self.throttle.succeeded(*keys)
        if _ROLE_RANK[user.role] < _ROLE_RANK[needed]:
            raise Forbidden(f"user {user_name!r} may only read from {self.name!r}")

    def _check_length(self, key: str, declared: str | None) -> None:
        """Refuse a declared Content-Length over ``max_entry_size``: decided before any
        body byte is read, so a client sending Expect: 100-continue never sends it."""
        if declared is None:
            return
        if not (declared.isascii() and declared.isdigit()):  # isdigit alone takes "²"
            raise BadRequest(f"Content-Length {declared!r} is not a number")
        limit = self.options.max_entry_size
        if int(declared) > limit:
            raise PayloadTooLarge(
                f"{key}: {declared} bytes is over this cache's {limit}-byte entry limit"
            )

    async def _put(self, request: Request, key: str) -> Response:
        self._check_length(key, request.headers.get("content-length"))
        content_type = request.headers.get("content-type") or CONTENT_TYPE
        await self.store.store(key, request.body(), self.options.max_entry_size, content_type)
        return self.responses.empty(201)


FORMAT = FormatPlugin(
    name="gradle-build-cache",
    options=BuildCacheOptions,
    hosting=Hosting(build=BuildCacheRepository, max_size=lambda options: options.max_size),
    default_repository=_default_repository,
    validate=_validate,
    warnings=_warnings,
)

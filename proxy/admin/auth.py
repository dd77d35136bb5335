"""Who may use the console (``/ui/``) and the admin API (``/api/``), and the checks
that keep a browser from being used against them (docs/architecture.md, "Operating:
console, API and logs").

- **Users** are ``[admin.users.<name>]`` with a password (HTTP Basic) and/or a token
  (``Authorization: Bearer``), compared as SHA-256 digests in constant time.
- **No users**: 403 naming ``admin.users``, except that with the embedded defaults on a
  loopback address the console's reads are open to this machine's own clients (a first
  look on one's own machine; not what a reverse proxy forwards, nor a request naming
  another host, as a DNS-rebinding page's does).
  ``admin.anonymous = "read"`` opens the reads to anyone; writes always need a user.
- **Wrong credentials** are logged and throttled (``runtime.throttle``): a known user's
  wrong passwords lock that user, guesses of unknown names or tokens lock the client
  address; 429 with Retry-After while locked.
- **Cross-site requests**: a browser sends cached Basic credentials with any request,
  so every write (any method but GET/HEAD) must come from our own origin (Origin, or
  Referer, must match the Host or ``server.public_url``; ``Sec-Fetch-Site: cross-site``
  is refused), console
  forms must carry the user's CSRF token, and API writes with Basic credentials must
  be JSON (a cross-site form cannot send that without a CORS preflight we never grant).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

from proxy.config.settings import AdminUser, Settings
from proxy.runtime.throttle import FailureThrottle

log = logging.getLogger("proxy.admin")

REALM = "proxy admin"
SAFE_METHODS = frozenset({"GET", "HEAD"})
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


@dataclass(frozen=True)
class Caller:
    """Who is asking: a user (``name``), or anyone (``name`` None, reads only)."""

    name: str | None
    scheme: str  # basic | bearer | anonymous
    csrf_token: str = ""

    @property
    def can_write(self) -> bool:
        return self.name is not None


class Refused(Exception):
    """An answer instead of the page: 401, 403 or 429, with a message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """The name or address of a Host header's ``name[:port]`` or ``[v6][:port]``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class AdminAuth:
    def __init__(self, settings: Settings, throttle: FailureThrottle | None = None) -> None:
        self.admin = settings.admin
        self.public_url = settings.public_url
        self.throttle = throttle or FailureThrottle()
        # A first look on one's own machine: no file, loopback only, reads only.
        self.anonymous_reads = self.admin.anonymous == "read"
        self.local_reads = settings.source == "embedded defaults" and loopback(settings.host)

    def _reads_open_to(self, request: Request) -> bool:
        """Whether anyone may read, for this request. The embedded defaults' exception
        is for this machine's own clients: a reverse proxy on the same machine in front
        of the loopback address would make every client of the world look local."""
        if self.anonymous_reads:
            return True
        if not self.local_reads:
            return False
        client = request.client.host if request.client else ""
        if not loopback(client) or any(h in request.headers for h in FORWARDING_HEADERS):
            return False
        # DNS rebinding: a page of another site whose name now resolves to 127.0.0.1
        # reads the console through this machine's browser, same-origin for the page,
        # but with that site's name as Host. A look on one's own machine names it.
        return loopback(host_name(request.headers.get("host", "")))

    def caller(self, request: Request) -> Caller:
        """The caller of ``request``, or ``Refused``; writes are checked too."""
        write = request.method not in SAFE_METHODS
        authorization = request.headers.get("authorization")
        client = request.client.host if request.client else "-"
        open_reads = self._reads_open_to(request)
        if not self.admin.users:
            if write or not open_reads:
                raise Refused(
                    403,
                    "the console and the admin API need an admin user: add "
                    "[admin.users.NAME] with password (or password_sha256) to the config "
                    "(admin.users)" + ("; changes always need one" if open_reads else ""),
                )
            return Caller(None, "anonymous")
        if authorization:
            caller = self._authenticated(authorization, client)
        elif open_reads and not write:
            caller = Caller(None, "anonymous")
        else:
            raise self._challenge("log in as an admin user (admin.users)")
        if write:
            if not caller.can_write:
                raise self._challenge("changes need an admin user (admin.users)")
            check_same_origin(request, self.public_url)
        return caller

    def _authenticated(self, authorization: str, client: str) -> Caller:
        scheme, _, credentials = authorization.partition(" ")
        scheme = scheme.lower()
        name = None
        user: AdminUser | None = None
        keys: tuple[str, ...]
        if scheme == "basic":
            try:
                decoded = base64.b64decode(credentials.strip(), validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise Refused(400, "the Basic credentials are not valid base64") from None
            name, _, password = decoded.partition(":")
            candidate = self.admin.user(name)
            # A known user's wrong passwords lock that user (not the client address: a
            # load balancer's would lock everyone out); guesses of unknown names lock the
            # client that makes them.
            keys = (f"user:{name}",) if candidate is not None else (f"client:{client}",)
            self._check_throttle(keys)
            if candidate is not None and _matches(password, candidate.password_sha256):
                user = candidate
        elif scheme == "bearer":
            keys = (f"client:{client}",)
            self._check_throttle(keys)
            token = credentials.strip()
            user = next((u for u in self.admin.users if _matches(token, u.token_sha256)), None)
        else:
            raise self._challenge(f"unsupported authorization scheme {scheme!r}; use Basic")
        if user is None:
            self.throttle.failed(*keys)
            log.warning(
                "admin login failed: scheme=%s user=%s client=%s", scheme, name or "-", client
            )
            raise self._challenge("wrong user name or password")
        self.throttle.succeeded(*keys)
        return Caller(user.name, scheme, csrf_token(user))

    def _check_throttle(self, keys: tuple[str, ...]) -> None:
        wait_s = self.throttle.retry_after(*keys)
        if wait_s is not None:
            raise Refused(
                429,
                "too many wrong passwords; try again later",
                {"retry-after": str(max(1, int(wait_s + 0.999)))},
            )

    def _challenge(self, message: str) -> Refused:
        return Refused(401, message, {"www-authenticate": f'Basic realm="{REALM}"'})


def _matches(secret: str, sha256: str | None) -> bool:
    if sha256 is None:
        return False
    digest = hashlib.sha256(secret.encode()).hexdigest()
    return hmac.compare_digest(digest, sha256)


def csrf_token(user: AdminUser) -> str:
    """The user's token for console forms: derived from the user's secret, so every
    replica of the fleet computes the same one and a changed password changes it; it
    reveals nothing of the secret."""
    key = (user.password_sha256 or user.token_sha256 or "").encode()
    return hmac.new(key, f"csrf:{user.name}".encode(), hashlib.sha256).hexdigest()[:32]


def notice_signature(caller: Caller, notice: str) -> str:
    """What vouches that the console wrote ``notice`` for this user: a notice after a
    form travels in the redirect's URL, and a link of anyone's could put words in the
    console's mouth. Keyed like the CSRF token, so it holds on every replica; shown to
    users only (anonymous callers change nothing, so get no notices)."""
    key = caller.csrf_token.encode()
    return hmac.new(key, f"notice:{notice}".encode(), hashlib.sha256).hexdigest()


def check_csrf(caller: Caller, given: str | None) -> None:
    if not given or not hmac.compare_digest(given, caller.csrf_token):
        raise Refused(403, "the form's CSRF token is missing or wrong; reload the page")


def check_same_origin(request: Request, public_url: str | None = None) -> None:
    """Refuse a write that a page of another origin made the browser send. Ours are
    the Host the request names and ``server.public_url``: behind a load balancer the
    browser's Origin is the public address, while the Host a replica sees is whatever
    the balancer passes on."""
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise Refused(403, "cross-site requests may not change anything")
    source = request.headers.get("origin") or request.headers.get("referer")
    if not source or source == "null":
        if source == "null":
            raise Refused(403, "requests from an opaque origin may not change anything")
        return  # not a browser (curl, scripts): nothing to protect against
    ours = {request.headers.get("host", "").lower()}
    if public_url is not None:
        ours.add(urlsplit(public_url).netloc.lower())
    if urlsplit(source).netloc.lower() not in ours:
        raise Refused(403, f"cross-origin requests may not change anything (from {source})")

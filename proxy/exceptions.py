"""The proxy's one exception hierarchy.

    ProxyError
    ├── ConfigError            a setting is bad; lists every bad key
    ├── InvalidPlugin          a format's plugin lacks what it declares (at registration)
    ├── ClientError            the request is bad (4xx)
    │   ├── BadRequest         400
    │   ├── Unauthorized       401, with the format's challenge
    │   ├── Forbidden          403
    │   │   └── ReleaseWithheld    the release policy holds or denies this version
    │   ├── NotFound           404: confirmed missing upstream, or never listed
    │   │   └── NotSupported     an endpoint of the protocol the proxy does not offer
    │   ├── MethodNotAllowed   405, with the methods allowed
    │   ├── NotAcceptable      406: no representation the Accept header takes
    │   ├── RequestTimeout     408: a request body that stalled
    │   ├── Conflict           409: not now, in the state it is (a finished mirror run)
    │   ├── PayloadTooLarge    413: over a repository's max_entry_size
    │   ├── UnsupportedMediaType  415: a body not of the type the endpoint takes
    │   ├── UriTooLong         414
    │   ├── TooManyRequests    429 + Retry-After: too many wrong passwords, for now
    │   └── HeadersTooLarge    431
    ├── Unavailable            503 + Retry-After: the proxy cannot answer now; a retry may
    │   ├── NotConfigured        the repository has no upstream URL
    │   ├── ShuttingDown         the process is stopping
    │   ├── CatalogError         the database failed (sqlite3/asyncpg errors, translated)
    │   │   └── JobLockLost        a job pass's lock went with its connection: pass stopped
    │   └── StorageError         the blob store failed (disk full, shared volume gone)
    │       └── StorageUnavailable  the object storage is unreachable or throttling
    └── FetchError             getting a key's body failed: a stale copy answers instead
        ├── UpstreamError      the upstream failed, and only the upstream: 502
        │   ├── UpstreamTimeout      504: no head, no body, or too slow, in time
        │   ├── UpstreamUnavailable  502: refused, reset, 5xx, a broken body
        │   │   └── UpstreamBusy     503 + Retry-After: it answered 429 or 503
        │   │       └── UpstreamDown   it failed in a row: not asked for a while
        │   ├── AddressRefused       502: it sent us to an internal address
        │   ├── DigestMismatch       502: bytes do not match the listed digest
        │   └── ContentMismatch      502: bytes are not what the key holds (a login
        │                            page instead of a jar), and nothing verified them
        ├── RetryLater         503 + Retry-After: a limit of ours (parsers or memory
        │                      budget busy, an upstream host's slots full) or a step
        │                      not done yet (stored but not recorded)
        ├── ParseFailed        502: what the upstream sent could not be parsed in time
        └── TransferCut        502: a body being streamed ended before its end
            └── BodyChanged      the upstream's file changed between two downloads

The HTTP answer to each class (status, headers such as Retry-After, log level) is
decided in one place, ``http/errors.py``, looked up along the class's MRO; the classes
carry only what the answer needs to say (a message, the methods allowed, a wait).

Foreign errors are translated once, at the boundary, with ``raise ... from exc``:
httpx errors in ``upstream/client.py``, sqlite3 and asyncpg errors in ``catalog/``,
botocore and aiohttp errors in ``storage/s3.py``.
"""

from __future__ import annotations

import errno
import os


class ProxyError(Exception):
    """Base of every error the proxy raises on purpose."""


class ConfigError(ProxyError):
    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("; ".join(errors))


class InvalidPlugin(ProxyError):
    """A format's ``FORMAT`` does not provide what it declares; the message names the
    format and every problem."""


# -- the request is bad -----------------------------------------------------------------


class ClientError(ProxyError):
    """The request cannot be answered as asked (a 4xx)."""


class BadRequest(ClientError):
    pass


class Unauthorized(ClientError):
    def __init__(self, message: str, challenge: str | None = None) -> None:
        super().__init__(message)
        self.challenge = challenge  # the WWW-Authenticate value, e.g. 'Basic realm="x"'


class Forbidden(ClientError):
    pass


class ReleaseWithheld(Forbidden):
    """The release policy holds back or denies the version a key belongs to. ``problem``
    is the RFC 9457 problem document (the same facts as the message), for clients that
    ask for ``application/problem+json``."""

    def __init__(self, message: str, problem: dict[str, object]) -> None:
        super().__init__(message)
        self.problem = problem


class NotFound(ClientError):
    pass


class NotSupported(NotFound):
    """An endpoint of the client's protocol that this proxy does not offer (search,
    login...); the message says what and where to go instead. A 404, not a 501: clients
    retry 5xx answers (npm for over a minute), and this refusal never changes."""


class MethodNotAllowed(ClientError):
    def __init__(self, message: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed


class NotAcceptable(ClientError):
    """No representation the client accepts (content negotiation by Accept)."""


class RequestTimeout(ClientError):
    pass


class Conflict(ClientError):
    pass


class PayloadTooLarge(ClientError):
    pass


class UnsupportedMediaType(ClientError):
    pass


class UriTooLong(ClientError):
    pass


class HeadersTooLarge(ClientError):
    pass


class TooManyRequests(ClientError):
    """This client or user failed too often (wrong passwords): refused for
    ``retry_after_s`` without a look at its credentials."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# -- we cannot answer now ------------------------------------------------------------------


class Unavailable(ProxyError):
    """The proxy cannot answer now; a retry after ``retry_after_s`` may succeed."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotConfigured(Unavailable):
    pass


class ShuttingDown(Unavailable):
    pass


class CatalogError(Unavailable):
    pass


class JobLockLost(CatalogError):
    """The connection that held a job's lock is gone, so the lock is too: the pass was
    stopped, since another replica may already run the job."""


class StorageError(Unavailable):
    @classmethod
    def from_os_error(cls, what: str, exc: OSError) -> StorageError:
        """``what`` failed with ``exc``, named by its errno (``ENOSPC``, ``EIO``...), so
        the log says at once whether the disk is full or failing."""
        return cls(f"{what}: {describe_os_error(exc)}")


class StorageFull(StorageError):
    """A body may not be downloaded: it would leave the storage with less than
    ``storage.min_free`` free (docs/architecture.md, "Storage faults"). The upstream's
    answer was not read past its head; cached files are still served."""


# -- getting a body failed -------------------------------------------------------------------


class FetchError(ProxyError):
    """Getting a key's body failed. The miss path serves a stale copy instead, where
    there is one, and marks its lease failed."""


class UpstreamError(FetchError):
    """The upstream could not give us the bytes. Never a 404 to clients."""


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamUnavailable(UpstreamError):
    pass


class UpstreamBusy(UpstreamUnavailable):
    """The upstream answered 429 or 503: it asks us to come back later."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamDown(UpstreamBusy):
    """The upstream host failed so often in a row that it is not asked again until
    ``retry_after_s`` has passed (its circuit is open: ``upstream/circuit.py``)."""


class AddressRefused(UpstreamError):
    """A URL the upstream gave (a listed file, a redirect) names an address the
    repository may not reach (docs/architecture.md, "Upstream safety")."""


class DigestMismatch(UpstreamError):
    pass


class ContentMismatch(UpstreamError):
    """The body fails the content check of its kind (``types.Content``) and no digest
    verified it: an HTML login or error page where a jar, a wheel or metadata belongs."""


class RetryLater(FetchError):
    """A limit of ours was reached, or a step is not done yet: not the upstream's fault."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ParseFailed(FetchError):
    """What the upstream sent could not be parsed within ``upstream.parse_timeout``."""


class TransferCut(FetchError):
    """A body being streamed to clients ended before its end (the download failed, or
    its file could not be read); clients that had its headers see a short body."""


class BodyChanged(TransferCut):
    """The upstream's file changed between two downloads of one transfer: the bytes
    already sent are not a prefix of the new body."""


def describe_os_error(exc: OSError) -> str:
    """``ENOSPC (No space left on device)`` for an OSError; its text otherwise."""
    name = errno.errorcode.get(exc.errno or 0)
    if name is None:
        return str(exc)
    return f"{name} ({exc.strerror or os.strerror(exc.errno or 0)})"


class StorageUnavailable(StorageError):
    """The object storage cannot be reached, or keeps refusing (throttling), after the
    bounded retries: clients get a 503 with Retry-After that says so."""

"""The proxy's one exception hierarchy.

    ProxyError
    ├── ConfigError            a setting is bad; lists every bad key
    ├── ClientError            the request is bad (4xx); carries the status
    │   ├── NotFound           404: confirmed missing upstream, or never listed
    │   ├── Unauthorized       401 (with the format's challenge) / Forbidden 403
    │   ├── MethodNotAllowed   405 (with Allow)
    │   ├── NotAcceptable      406: no representation the Accept header takes
    │   ├── RequestTimeout     408: a request body that stalled
    │   ├── PayloadTooLarge    413: over a repository's max_entry_size
    │   └── BadRequest         400 (and 414/431 via ``status``)
    ├── NotConfigured          503: the repository has no upstream URL
    ├── ShuttingDown           503: the process is stopping
    ├── UpstreamError          the upstream failed (5xx/timeout/connection/protocol)
    │   ├── UpstreamTimeout    504
    │   ├── UpstreamUnavailable  502/503 (connection refused, 5xx, 429)
    │   └── DigestMismatch     502: bytes do not match the listed digest
    ├── CatalogError           the database failed (sqlite3/asyncpg errors, translated)
    │   └── JobLockLost        a job pass's lock went with its connection: pass stopped
    └── StorageError           the blob store failed (disk full, shared volume gone): 503

Foreign errors are translated once, at the boundary, with ``raise ... from exc``:
httpx errors in ``upstream/client.py``, sqlite3 and asyncpg errors in ``catalog/``.
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


class ClientError(ProxyError):
    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status

    @property
    def headers(self) -> dict[str, str]:
        """Headers the answer needs (an Allow, a challenge)."""
        return {}


class BadRequest(ClientError):
    status = 400


class NotFound(ClientError):
    status = 404


class Unauthorized(ClientError):
    status = 401

    def __init__(self, message: str, challenge: str | None = None) -> None:
        super().__init__(message)
        self.challenge = challenge  # the WWW-Authenticate value, e.g. 'Basic realm="x"'

    @property
    def headers(self) -> dict[str, str]:
        return {"www-authenticate": self.challenge} if self.challenge else {}


class Forbidden(ClientError):
    status = 403


class MethodNotAllowed(ClientError):
    status = 405

    def __init__(self, message: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed

    @property
    def headers(self) -> dict[str, str]:
        return {"allow": ", ".join(self.allowed)}


class NotAcceptable(ClientError):
    """406: no representation the client accepts (content negotiation by Accept)."""

    status = 406

    @property
    def headers(self) -> dict[str, str]:
        return {"vary": "Accept"}


class RequestTimeout(ClientError):
    status = 408


class PayloadTooLarge(ClientError):
    status = 413


class NotConfigured(ProxyError):
    status = 503


class ShuttingDown(ProxyError):
    status = 503


class UpstreamError(ProxyError):
    """The upstream could not give us the bytes. Never a 404 to clients."""

    status = 502


class UpstreamTimeout(UpstreamError):
    status = 504


class UpstreamUnavailable(UpstreamError):
    status = 502

    def __init__(self, message: str, status: int = 502, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class DigestMismatch(UpstreamError):
    status = 502


class CatalogError(ProxyError):
    status = 503


class JobLockLost(CatalogError):
    """The connection that held a job's lock is gone, so the lock is too: the pass was
    stopped, since another replica may already run the job."""


class StorageError(ProxyError):
    status = 503

    @classmethod
    def from_os_error(cls, what: str, exc: OSError) -> StorageError:
        """``what`` failed with ``exc``, named by its errno (``ENOSPC``, ``EIO``...), so
        the log says at once whether the disk is full or failing."""
        return cls(f"{what}: {describe_os_error(exc)}")


def describe_os_error(exc: OSError) -> str:
    """``ENOSPC (No space left on device)`` for an OSError; its text otherwise."""
    name = errno.errorcode.get(exc.errno or 0)
    if name is None:
        return str(exc)
    return f"{name} ({exc.strerror or os.strerror(exc.errno or 0)})"

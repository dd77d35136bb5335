"""The proxy's one exception hierarchy.

    ProxyError
    ├── ConfigError            a setting is bad; lists every bad key
    ├── ClientError            the request is bad (4xx); carries the status
    │   ├── NotFound           404: confirmed missing upstream, or never listed
    │   ├── Unauthorized       401 (with a Basic challenge) / Forbidden 403
    │   ├── PayloadTooLarge    413: over a repository's max_entry_size
    │   └── BadRequest         400 (and 406/414/431 via ``status``)
    ├── NotConfigured          503: the repository has no upstream URL
    ├── ShuttingDown           503: the process is stopping
    ├── UpstreamError          the upstream failed (5xx/timeout/connection/protocol)
    │   ├── UpstreamTimeout    504
    │   ├── UpstreamUnavailable  502/503 (connection refused, 5xx, 429)
    │   └── DigestMismatch     502: bytes do not match the listed digest
    ├── CatalogError           the database failed (sqlite3/asyncpg errors, translated)
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


class BadRequest(ClientError):
    status = 400


class NotFound(ClientError):
    status = 404


class Unauthorized(ClientError):
    status = 401


class Forbidden(ClientError):
    status = 403


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

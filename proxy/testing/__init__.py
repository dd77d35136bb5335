"""Test doubles at the seams, shipped with the code (docs/architecture.md, "Test seams").

- ``MemoryCatalog``: every operation of the ``catalog.Catalog`` protocol in memory,
  leases with fences, tombstones and job runs included, judged by a ``Clock`` (move a
  ``ManualClock`` to expire a lease). The catalog's own tests run on it as on SQLite
  and Postgres, so it means what they mean.
- ``MockUpstream``: a ``contract.UpstreamClient`` that answers with a handler function,
  as httpx's ``MockTransport`` does; it records every request.
- ``InMemoryProxy``: the whole app (engine, formats, error table) over those two,
  called through ``httpx.ASGITransport``: a format's unit test needs no socket, no
  server thread and no database.

Nothing in the package imports this module (tests/test_architecture.py checks it).
"""

from __future__ import annotations

from proxy.testing.app import InMemoryProxy
from proxy.testing.catalog import MemoryCatalog
from proxy.testing.upstream import (
    Handler,
    MockResponse,
    MockUpstream,
    UpstreamRequest,
    static_upstream,
)

__all__ = [
    "Handler",
    "InMemoryProxy",
    "MemoryCatalog",
    "MockResponse",
    "MockUpstream",
    "UpstreamRequest",
    "static_upstream",
]

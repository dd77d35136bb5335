"""The ceiling of the proxy's stack for bench/hits.py: a bare ASGI app on uvicorn
(httptools, uvloop) answering 11 KB from memory with the headers of a proxy hit, doing
no work at all.

    python -m uvicorn bench.bare_asgi:app --loop uvloop --http httptools --no-access-log
"""

from __future__ import annotations

import os
from typing import Any

BODY = os.urandom(11 * 1024)
HEADERS = [
    (b"content-type", b"application/octet-stream"),
    (b"cache-control", b"public, max-age=31536000, immutable"),
    (b"etag", b'"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"'),
    (b"last-modified", b"Thu, 01 Jan 2026 00:00:00 GMT"),
    (b"accept-ranges", b"bytes"),
    (b"content-length", str(len(BODY)).encode()),
]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})

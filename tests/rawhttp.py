"""Send a request exactly as written (clients normalize '..' and '//' away)."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit


def raw_get(
    base_url: str,
    target: str,
    headers: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
) -> tuple[int, bytes]:
    """``headers``: a mapping, or (name, value) pairs to send a name more than once."""
    parts = urlsplit(base_url)
    given = list((headers or {}).items()) if isinstance(headers, Mapping | None) else headers
    lines = [f"GET {target} HTTP/1.1", "Connection: close"]
    if not any(name.lower() == "host" for name, _value in given):
        lines.append(f"Host: {parts.netloc}")
    lines += [f"{name}: {value}" for name, value in given]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    response = b"".join(chunks)
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body

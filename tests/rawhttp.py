"""Requests sent exactly as written (clients normalize '..' and '//' away), and answers
read off a socket as they come."""

from __future__ import annotations

import socket
import time
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


def read_response(
    sock: socket.socket, buffered: bytes = b"", pause_s: float = 0.0
) -> tuple[bytes, bytes, bytes]:
    """(head, body, what follows) of the next response on a kept-alive connection (a
    Content-Length body; none without one). ``buffered``: bytes already read from it;
    ``pause_s``: a slow reader's pause between reads."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the head: {data[:200]!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    chunks, received = [rest], len(rest)
    while received < length:
        chunk = sock.recv(min(65536, length - received))
        assert chunk, f"closed after {received} of {length} body bytes"
        chunks.append(chunk)
        received += len(chunk)
        if pause_s:
            time.sleep(pause_s)
    rest = b"".join(chunks)
    return head, rest[:length], rest[length:]

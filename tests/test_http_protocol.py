"""Our HTTP protocol (proxy/http/protocol.py) in process, with its head timeout made
short: a pipelined request head never gets a refusal written into the response before
it (issue 18)."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.config.load import load
from proxy.http import protocol
from proxy.http.app import create_app
from tests.conftest import write_config
from tests.rawhttp import read_response
from tests.upstream import FakeUpstream, ServerThread

MiB = 1024 * 1024


@pytest.fixture
def guarded_proxy(
    tmp_path: Path, upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ServerThread]:
    monkeypatch.setattr(protocol, "HEAD_TIMEOUT_S", 0.5)
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "files"
        format = "raw"
        upstream = "{upstream.base_url}/"
        """,
    )
    app = create_app(load(config, {}))
    server = ServerThread(app, loop="asyncio", http=protocol.GuardedHttpToolsProtocol).start()
    yield server
    server.stop()


def test_a_pipelined_head_is_timed_from_the_end_of_the_response_before_it(
    guarded_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = os.urandom(16 * MiB)
    upstream.files["/big.bin"] = body
    port = int(guarded_proxy.url.rsplit(":", 1)[1])
    warm = socket.create_connection(("127.0.0.1", port))
    warm.sendall(b"GET /files/big.bin HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(warm, b"")[1] == body  # cached: the next answer is a hit
    warm.close()

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(20)
    # The next request's head begins (and stalls) while the 16 MiB answer is sent, and
    # the client reads slowly: the answer takes several head timeouts.
    sock.sendall(b"GET /files/big.bin HTTP/1.1\r\nHost: x\r\n\r\nGET /files/big.bin HTTP/1.1\r\nHo")
    time.sleep(2.0)
    head, got, after = read_response(sock, b"")
    assert head.startswith(b"HTTP/1.1 200")
    assert hashlib.sha256(got).digest() == hashlib.sha256(body).digest(), "the body was spliced"
    # Then the half-sent head gets its 408, after the body and only after its own timeout.
    rest = after
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in rest and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    assert rest.startswith(b"HTTP/1.1 408"), rest[:200]
    sock.close()

"""Slow and hostile clients against a real `proxy serve` (proxy/http/protocol.py,
proxy/http/server.py): half-sent heads time out, huge heads are refused before they are
buffered, clients that never read cost a bounded buffer each, and a user's metrics
folder survives --workers."""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.http.protocol import HEAD_TIMEOUT_S, MAX_HEAD_BYTES
from tests import hostile
from tests.conftest import write_config
from tests.processes import ProxyProcess
from tests.rawhttp import read_response
from tests.upstream import FakeUpstream

pytestmark = pytest.mark.slow

MiB = 1024 * 1024


@pytest.fixture
def proxy(tmp_path: Path, upstream: FakeUpstream) -> Iterator[ProxyProcess]:
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
    process = ProxyProcess(config, tmp_path, "proxy").start().wait_ready()
    yield process
    process.stop()


def test_half_sent_heads_time_out_and_the_proxy_keeps_serving(
    proxy: ProxyProcess, upstream: FakeUpstream
) -> None:
    upstream.files["/a.txt"] = b"a"
    sockets = hostile.open_sockets(proxy.port, 200, b"GET /files/a.txt HTTP/1.1\r\nHost: x\r\n")
    idle = hostile.open_sockets(proxy.port, 50, b"")
    try:
        assert httpx.get(proxy.url + "/files/a.txt", timeout=5).content == b"a"
        deadline = HEAD_TIMEOUT_S + 10
        answer = hostile.closed_by_server(sockets[0], deadline)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
        for sock in sockets[1:] + idle:
            assert hostile.closed_by_server(sock, 5) is not None, "a connection stayed open"
    finally:
        for sock in sockets + idle:
            sock.close()


def test_a_huge_head_is_refused_before_it_is_buffered(proxy: ProxyProcess) -> None:
    before = proxy.rss_mib()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"GET /files/a.txt HTTP/1.1\r\nX-Long: ")
        sent = 0
        try:
            while sent < 64 * MiB:  # never ends the line; the server must cut us off
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = hostile.closed_by_server(sock, 10)
    assert sent < 8 * MiB, f"{sent} bytes were taken before the refusal"
    assert answer is None or answer == b"" or answer.startswith(b"HTTP/1.1 431")
    assert proxy.rss_mib() - before < 32
    assert MiB > MAX_HEAD_BYTES


def test_clients_that_never_read_cost_a_bounded_buffer_each(
    proxy: ProxyProcess, upstream: FakeUpstream
) -> None:
    upstream.files["/big.bin"] = os.urandom(8 * MiB)
    assert len(httpx.get(proxy.url + "/files/big.bin", timeout=30).content) == 8 * MiB
    before = proxy.rss_mib()
    request = b"GET /files/big.bin HTTP/1.1\r\nHost: x\r\n\r\n"
    sockets = []
    for _ in range(300):
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request)
        sockets.append(sock)
    try:
        time.sleep(3)  # every response has stalled on its client by now
        grown = proxy.rss_mib() - before
        print(f"300 stalled clients: +{grown:.0f} MiB")
        assert grown < 300, f"300 stalled clients cost {grown:.0f} MiB"  # was 669 MiB
        assert httpx.get(proxy.url + "/healthz", timeout=5).status_code == 200
    finally:
        for sock in sockets:
            sock.close()


def asking_with_receive_buffer(port: int, request: bytes, receive_buffer: int) -> socket.socket:
    """A client socket with this receive buffer that has sent ``request``. The buffer is
    set before connecting, so the window is sized for it (an 8 KiB buffer set after
    connecting makes loopback TCP crawl at 80 KB/s, with or without us)."""
    sock = socket.socket()
    sock.settimeout(30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock


def test_a_miss_streamed_to_slow_readers_arrives_exact_beside_stalled_ones(
    proxy: ProxyProcess, upstream: FakeUpstream
) -> None:
    """Bytes of a download in progress go to a client by sendfile while its socket takes
    them, and by the ordinary write path when it is full (proxy/http/protocol.py,
    SocketFileSender): small receive buffers and pauses make the two alternate often."""
    body = os.urandom(16 * MiB)
    upstream.files["/growing.bin"] = body
    upstream.fault("/growing.bin", chunk_size=512 * 1024, chunk_delay_s=0.02)
    served_before = proxy.metric("proxy_bytes_served_total", repository="files")
    request = b"GET /files/growing.bin HTTP/1.1\r\nHost: x\r\n\r\n"
    stalled: list[socket.socket] = []
    slow: list[socket.socket] = []
    for i in range(8):
        sock = asking_with_receive_buffer(proxy.port, request, 32768 if i % 2 else 131072)
        (stalled if i < 2 else slow).append(sock)
    try:
        results = [read_response(sock, pause_s=0.001 * (i % 3)) for i, sock in enumerate(slow)]
        for head, received, _rest in results:
            assert head.startswith(b"HTTP/1.1 200")
            assert hashlib.sha256(received).digest() == hashlib.sha256(body).digest()
        assert upstream.count("/growing.bin") == 1
    finally:
        for sock in stalled + slow:
            sock.close()
    served = proxy.metric("proxy_bytes_served_total", repository="files") - served_before
    # The slow readers' bytes, and whatever the stalled ones' sockets took.
    assert len(slow) * len(body) <= served < (len(slow) + len(stalled)) * len(body)


def test_a_stored_file_sent_by_sendfile_arrives_exact_and_leaves_no_descriptor(
    proxy: ProxyProcess, upstream: FakeUpstream
) -> None:
    """A stored file known good goes to the socket by sendfile in the I/O pool
    (FileResponse), the ordinary way while the socket is full: slow readers get every
    byte, ranges their bytes, and clients that leave mid-file (while a sendfile may be
    running in its thread) leave no descriptor behind, neither the file's nor the
    socket duplicate the thread sends through."""
    body = os.urandom(24 * MiB)
    upstream.files["/stored.bin"] = body
    assert httpx.get(proxy.url + "/files/stored.bin", timeout=30).content == body  # the miss
    assert httpx.get(proxy.url + "/files/stored.bin", timeout=30).content == body  # stamped
    ranged = httpx.get(
        proxy.url + "/files/stored.bin", headers={"Range": "bytes=1000-9000999"}, timeout=30
    )
    assert ranged.status_code == 206 and ranged.content == body[1000:9001000]

    def open_descriptors() -> int:
        return len(os.listdir(f"/proc/{proxy.pid}/fd"))

    before = open_descriptors()
    served_before = proxy.metric("proxy_bytes_served_total", repository="files")
    request = b"GET /files/stored.bin HTTP/1.1\r\nHost: x\r\n\r\n"
    readers: list[socket.socket] = []
    leavers: list[socket.socket] = []
    for i in range(10):
        sock = asking_with_receive_buffer(proxy.port, request, 65536 if i % 2 else 262144)
        (leavers if i < 4 else readers).append(sock)
    try:
        for sock in leavers:
            sock.recv(100_000)
            sock.close()
        for i, sock in enumerate(readers):
            head, received, _rest = read_response(sock, pause_s=0.0005 * (i % 3))
            assert head.startswith(b"HTTP/1.1 200")
            assert hashlib.sha256(received).digest() == hashlib.sha256(body).digest()
    finally:
        for sock in readers:
            sock.close()
    deadline = time.monotonic() + 10
    while open_descriptors() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_descriptors() <= before
    served = proxy.metric("proxy_bytes_served_total", repository="files") - served_before
    assert len(readers) * len(body) <= served < 10 * len(body)
    assert upstream.count("/stored.bin") == 1


def test_a_users_metrics_folder_is_kept_with_workers(tmp_path: Path) -> None:
    metrics_dir = tmp_path / "metrics"
    (metrics_dir / "subfolder").mkdir(parents=True)
    (metrics_dir / "notes.txt").write_text("mine")
    (metrics_dir / "counter_999999999.db").write_bytes(b"not ours")  # looks like a metrics file
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PROXY_STORAGE_PATH": str(tmp_path / "d")}
    proxy = ProxyProcess(None, tmp_path, "workers", env=env, workers=2).start()
    try:
        proxy.wait_ready()
        for _ in range(4):
            httpx.get(f"{proxy.url}/gradle-cache/abc", timeout=5)
        text = httpx.get(f"{proxy.url}/metrics").text
        assert 'proxy_http_requests_total{method="GET",repository="gradle-cache"' in text
    finally:
        proxy.stop()
    output = proxy.log()
    assert (metrics_dir / "notes.txt").read_text() == "mine"
    assert (metrics_dir / "subfolder").is_dir()
    assert (metrics_dir / "counter_999999999.db").read_bytes() == b"not ours"
    assert sorted(p.name for p in metrics_dir.iterdir()) == [
        "counter_999999999.db",
        "notes.txt",
        "subfolder",
    ], "our private folder inside it is gone"
    assert "Traceback" not in output, output


def test_a_metrics_folder_that_does_not_exist_yet_is_created(tmp_path: Path) -> None:
    metrics_dir = tmp_path / "not-yet"
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PROXY_STORAGE_PATH": str(tmp_path / "d")}
    proxy = ProxyProcess(None, tmp_path, "single", env=env).start()
    try:
        proxy.wait_ready()
        assert httpx.get(f"{proxy.url}/metrics").status_code == 200
    finally:
        proxy.stop()
    output = proxy.log()
    assert metrics_dir.is_dir() and "Traceback" not in output, output


def _raw_config(tmp_path: Path, upstream: FakeUpstream) -> Path:
    return write_config(
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


def test_a_low_open_files_limit_is_raised_and_idle_connections_starve_nobody(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    # Issue 18: at systemd's default soft limit of 1,024 descriptors, 1,100 idle
    # connections reset every legitimate request, with nothing logged.
    upstream.files["/a.txt"] = b"a" * 1000
    wrapper = ("prlimit", "--nofile=1024:8192", "--")
    proxy = ProxyProcess(_raw_config(tmp_path, upstream), tmp_path, "p", wrapper=wrapper)
    proxy.start().wait_ready()
    idle: list[socket.socket] = []
    try:
        assert "open files limit 8192 (raised from 1024)" in proxy.log()
        idle = hostile.open_sockets(proxy.port, 1100, b"")
        with httpx.Client(timeout=5) as client:
            for _ in range(20):
                assert client.get(proxy.url + "/files/a.txt").status_code == 200
    finally:
        for sock in idle:
            sock.close()
        proxy.stop()


def test_a_hard_limit_that_cannot_be_raised_is_said_at_start(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    wrapper = ("prlimit", "--nofile=1024:1024", "--")
    proxy = ProxyProcess(_raw_config(tmp_path, upstream), tmp_path, "p", wrapper=wrapper)
    proxy.start().wait_ready()
    try:
        assert "open files limit 1024, the hard limit: at most 384 connections" in proxy.log()
        assert "LimitNOFILE" in proxy.log()
    finally:
        proxy.stop()

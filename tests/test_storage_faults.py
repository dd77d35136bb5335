"""A full disk, for real (proxy/storage/blobs.py, /readyz): the storage is a small tmpfs that a
`proxy serve` mounts in a mount namespace of its own (``unshare``), so nothing on this
machine is touched. ENOSPC is logged by name and counted, /readyz says why it is not
ready, and cached hits keep being served."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_config
from tests.pg import free_port
from tests.processes import metric_value
from tests.upstream import FakeUpstream

pytestmark = pytest.mark.slow

MiB = 1024 * 1024


def serve_on_tmpfs(
    tmp_path: Path, config: Path, storage: Path, port: int
) -> subprocess.Popen[bytes]:
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed to give the proxy a small disk of its own"
    # 8 MiB, 7 of them taken by a filler: a disk that is nearly full to begin with.
    script = (
        f"mount -t tmpfs -o size=8m tmpfs {storage} && "
        f"dd if=/dev/zero of={storage}/filler bs=1M count=7 2>/dev/null && "
        f"exec {sys.executable} -m proxy serve --config {config} --listen 127.0.0.1:{port}"
    )
    with (tmp_path / "proxy.log").open("wb") as log:
        return subprocess.Popen(
            [unshare, "--mount", "--map-root-user", "sh", "-c", script],
            cwd=Path.cwd(),
            env={**os.environ, "PYTHONPATH": str(Path.cwd())},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def test_a_full_disk_is_named_and_cached_hits_keep_serving(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    upstream.files["/small.bin"] = os.urandom(100_000)
    upstream.files["/large.bin"] = os.urandom(6 * MiB)
    config = write_config(
        tmp_path,
        f"""
        [database]
        url = "sqlite:///{tmp_path / "catalog.db"}"
        [storage]
        path = "{storage}"
        min_free = "1MiB"
        [[repositories]]
        name = "files"
        format = "raw"
        upstream = "{upstream.base_url}/"
        """,
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = serve_on_tmpfs(tmp_path, config, storage, port)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "proxy.log").read_text()
            try:
                httpx.get(url + "/healthz", timeout=1)  # not ready: the disk is nearly full
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        small = httpx.get(url + "/files/small.bin", timeout=10)
        assert small.status_code == 200
        try:
            large = httpx.get(url + "/files/large.bin", timeout=30)
            assert large.status_code in (502, 503) and "storage" in large.text, large.text
        except httpx.RemoteProtocolError:
            pass  # it had started streaming: cut short, never a wrong complete body
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 503 and "storage:" in ready.text, ready.text
        assert "under storage.min_free (1MiB)" in ready.text
        again = httpx.get(url + "/files/small.bin", timeout=10)
        assert again.status_code == 200 and again.content == small.content
        text = httpx.get(url + "/metrics", timeout=10).text
        assert metric_value(text, "proxy_storage_errors_total", errno="ENOSPC") >= 1
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    log = (tmp_path / "proxy.log").read_text()
    assert "ENOSPC" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_readyz_names_the_free_space_floor(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        min_free = "1000TB"
        """,
    )
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        answer = None
        while time.monotonic() < deadline:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert answer is not None and answer.status_code == 503
        assert "under storage.min_free (1000TB)" in answer.text, answer.text
        # What a load balancer asks: the volume is the same for every replica, so it
        # must not take them all out of rotation (cached hits are still served).
        local = httpx.get(f"http://127.0.0.1:{port}/readyz?scope=local", timeout=10)
        assert local.status_code == 200 and local.text.startswith("ready"), local.text
        odd = httpx.get(f"http://127.0.0.1:{port}/readyz?scope=nodes", timeout=10)
        assert odd.status_code == 400 and "scope" in odd.text
    finally:
        process.terminate()
        process.wait(timeout=30)

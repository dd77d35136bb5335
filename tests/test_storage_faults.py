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


FILL_7_MIB = "dd if=/dev/zero of={storage}/filler bs=1M count=7 2>/dev/null"


def serve_on_tmpfs(
    tmp_path: Path, config: Path, storage: Path, port: int, prepare: str = FILL_7_MIB
) -> subprocess.Popen[bytes]:
    """The proxy on an 8 MiB disk of its own; ``prepare`` (shell lines) runs in its mount
    namespace first: by default a filler takes 7 MiB, a disk nearly full to begin with."""
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed to give the proxy a small disk of its own"
    script = "\n".join(
        [
            "set -e",
            f"mount -t tmpfs -o size=8m tmpfs {storage}",
            prepare.format(storage=storage),
            f"exec {sys.executable} -m proxy serve --config {config} --listen 127.0.0.1:{port}",
        ]
    )
    with (tmp_path / "proxy.log").open("wb") as log:
        return subprocess.Popen(
            [unshare, "--mount", "--map-root-user", "sh", "-c", script],
            cwd=Path.cwd(),
            env={**os.environ, "PYTHONPATH": str(Path.cwd())},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def raw_config(tmp_path: Path, storage: Path, upstream: FakeUpstream, min_free: str) -> Path:
    return write_config(
        tmp_path,
        f"""
        [database]
        url = "sqlite:///{tmp_path / "catalog.db"}"
        [storage]
        path = "{storage}"
        min_free = "{min_free}"
        [[repositories]]
        name = "files"
        format = "raw"
        upstream = "{upstream.base_url}/"
        """,
    )


def wait_started(process: subprocess.Popen[bytes], url: str, tmp_path: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, (tmp_path / "proxy.log").read_text()
        try:
            httpx.get(url + "/healthz", timeout=1)  # not /readyz: the disk may be full
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise AssertionError("the proxy did not start in 30 s")


def wait_for_file(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout_s:.0f} s"
        time.sleep(0.05)


def test_a_full_disk_is_named_and_cached_hits_keep_serving(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    upstream.files["/small.bin"] = os.urandom(100_000)
    upstream.files["/large.bin"] = os.urandom(6 * MiB)
    # No Content-Length: nothing says in advance that it will not fit; the write fails.
    upstream.fault("/large.bin", chunked=True)
    config = raw_config(tmp_path, storage, upstream, min_free="256KiB")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = serve_on_tmpfs(tmp_path, config, storage, port)
    try:
        wait_started(process, url, tmp_path)
        small = httpx.get(url + "/files/small.bin", timeout=10)
        assert small.status_code == 200
        try:
            large = httpx.get(url + "/files/large.bin", timeout=30)
            assert large.status_code in (502, 503) and "storage" in large.text, large.text
        except httpx.RemoteProtocolError:
            pass  # it had started streaming: cut short, never a wrong complete body
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


def test_under_min_free_a_body_is_refused_before_it_is_read(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    """A disk under ``storage.min_free`` (a filler takes it there while the proxy runs):
    a miss answers 503 once the upstream's head is in, before its body is read (nothing
    is written, so no ENOSPC); a 404 is still a 404; hits keep serving; /readyz says why.
    Once the filler is gone the same miss is fetched. A download whose Content-Length
    would take the disk under the floor is refused the same way."""
    storage = tmp_path / "storage"
    storage.mkdir()
    fill, filled, free, freed = (tmp_path / name for name in ("fill", "filled", "free", "freed"))
    upstream.files["/small.bin"] = os.urandom(100_000)
    upstream.files["/other.bin"] = os.urandom(100_000)
    upstream.files["/large.bin"] = os.urandom(6 * MiB)
    # In the proxy's mount namespace: the filler comes and goes when the test says.
    prepare = (
        f"(while [ ! -e {fill} ]; do sleep 0.05; done\n"
        f" {FILL_7_MIB}; touch {filled}\n"
        f" while [ ! -e {free} ]; do sleep 0.05; done\n"
        f" rm -f {{storage}}/filler; touch {freed}) &"
    )
    config = raw_config(tmp_path, storage, upstream, min_free="2MiB")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = serve_on_tmpfs(tmp_path, config, storage, port, prepare)
    try:
        wait_started(process, url, tmp_path)
        small = httpx.get(url + "/files/small.bin", timeout=10)
        assert small.status_code == 200

        fill.touch()
        wait_for_file(filled)
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 503, ready.text
        assert "under storage.min_free (2MiB)" in ready.text, ready.text
        for _ in range(3):
            refused = httpx.get(url + "/files/other.bin", timeout=10)
            assert refused.status_code == 503, refused.text
            assert "storage is full" in refused.text, refused.text
            assert refused.headers.get("retry-after"), refused.headers
        assert upstream.count("/other.bin") == 3  # asked each time: a 404 would be answered
        text = httpx.get(url + "/metrics", timeout=10).text
        # Bodies read from the upstream so far: small.bin's alone.
        assert metric_value(text, "proxy_upstream_bytes_total", repository="files") == 100_000
        absent = httpx.get(url + "/files/absent.bin.sha512", timeout=10)
        assert absent.status_code == 404, absent.text  # a build tool's probe: not a 503
        hit = httpx.get(url + "/files/small.bin", timeout=10)
        assert hit.status_code == 200 and hit.content == small.content

        free.touch()
        wait_for_file(freed)
        fetched = httpx.get(url + "/files/other.bin", timeout=10)
        assert fetched.status_code == 200 and fetched.content == upstream.files["/other.bin"]
        assert upstream.count("/other.bin") == 4

        # ~7.8 MiB free: 6 MiB more would leave less than 2 MiB.
        large = httpx.get(url + "/files/large.bin", timeout=30)
        assert large.status_code == 503 and "storage is full" in large.text, large.text
        assert upstream.count("/large.bin") == 1
        text = httpx.get(url + "/metrics", timeout=10).text
        refusals = metric_value(
            text, "proxy_upstream_fetch_duration_seconds_count", outcome="storage_full"
        )
        assert refusals == 4, refusals
        assert metric_value(text, "proxy_storage_errors_total", errno="ENOSPC") == 0
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    log = (tmp_path / "proxy.log").read_text()
    assert "other.bin: the body was not fetched: storage:" in log, log[-3000:]
    assert "a 6.0 MiB download would leave less than storage.min_free (2MiB)" in log, log[-3000:]
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

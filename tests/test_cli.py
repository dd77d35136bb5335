"""`proxy serve` as operators run it: no settings at all, workers, crashes, bad databases."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import pypi_config, write_config
from tests.pg import free_port
from tests.processes import ProxyProcess, metric_value
from tests.upstream import FakeUpstream, ProjectFile

pytestmark = pytest.mark.slow

MiB = 1024 * 1024


def serve(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--listen", f"127.0.0.1:{port}", *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(Path.cwd()), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError("not ready")


def test_serve_with_no_settings_at_all(tmp_path: Path) -> None:
    process, url = serve(tmp_path)
    try:
        wait_ready(process, url)
        response = httpx.get(url + "/pypi/simple/requests/")
        assert response.status_code == 503
        assert "PROXY_UPSTREAM_PYPI" in response.text
        assert "repositories.pypi.upstream" in response.text
        maven = httpx.get(url + "/maven/org/example/lib/1.0/lib-1.0.jar")
        assert maven.status_code == 503 and "PROXY_UPSTREAM_MAVEN" in maven.text
        # The embedded build cache works out of the box (anonymous, local only).
        assert httpx.put(url + "/gradle-cache/abc123", content=b"x").status_code == 201
        assert httpx.get(url + "/gradle-cache/abc123").content == b"x"
        assert "proxy_http_requests_total" in httpx.get(url + "/metrics").text
        assert (tmp_path / "data" / "proxy.db").exists()
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0].decode()
    assert "repository 'pypi' has no upstream" in output
    assert "PROXY_UPSTREAM_PYPI" in output
    assert "Traceback" not in output


def test_serve_with_unreachable_database_fails_clearly(tmp_path: Path) -> None:
    env = {"PROXY_DATABASE_URL": f"postgresql://proxy@127.0.0.1:{free_port()}/proxy"}
    process, _url = serve(tmp_path, env=env)
    output = process.communicate(timeout=60)[0].decode()
    assert process.returncode == 1
    assert "database.url: cannot prepare the database" in output
    assert "Traceback" not in output


def test_migrate_command(tmp_path: Path) -> None:
    env = {**os.environ, "PROXY_STORAGE_PATH": str(tmp_path / "d")}
    first = subprocess.run(
        [sys.executable, "-m", "proxy", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert first.returncode == 0 and "0001_init" in first.stdout
    again = subprocess.run(
        [sys.executable, "-m", "proxy", "migrate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "up to date" in again.stdout


def test_sigkill_mid_download_leaves_only_a_temp_file(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    body = os.urandom(6 * MiB)
    f = ProjectFile("big-1.0.tar.gz", body)
    upstream.add_project("big", [f])
    upstream.fault(f"/packages/{f.filename}", chunk_size=MiB, chunk_delay_s=0.3)
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = ProxyProcess(config, tmp_path, "single").start().wait_ready()
    try:
        httpx.get(proxy.url + "/pypi/simple/big/")
        with httpx.stream(
            "GET", proxy.url + f"/pypi/files/big/{f.filename}", timeout=30
        ) as response:
            next(response.iter_bytes())
            proxy.signal(signal.SIGKILL)
            proxy.wait()
        sha = hashlib.sha256(body).hexdigest()
        blobs = {p.name for p in (tmp_path / "data" / "blobs").rglob("*") if p.is_file()}
        assert sha not in blobs
        temps = list((tmp_path / "data" / "tmp").iterdir())
        assert len(temps) == 1 and temps[0].suffix == ".part"
        # A restarted process takes the lease over once it expires and stores the file.
        upstream.clear_faults()
        restarted = ProxyProcess(config, tmp_path, "restarted").start().wait_ready()
        try:
            response = httpx.get(restarted.url + f"/pypi/files/big/{f.filename}", timeout=30)
            assert response.content == body
        finally:
            restarted.stop()
    finally:
        proxy.stop()


def test_workers_share_one_fetch_and_aggregate_metrics(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    body = os.urandom(4 * MiB)
    f = ProjectFile("big-1.0.tar.gz", body)
    upstream.add_project("big", [f])
    upstream.fault(f"/packages/{f.filename}", chunk_size=MiB, chunk_delay_s=0.3)
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = ProxyProcess(config, tmp_path, "workers", workers=2).start().wait_ready()
    try:
        assert httpx.get(proxy.url + "/pypi/simple/big/").status_code == 200

        async def many() -> list[bytes]:
            async with httpx.AsyncClient(
                timeout=60, limits=httpx.Limits(max_connections=30)
            ) as client:
                responses = await asyncio.gather(
                    *(client.get(proxy.url + f"/pypi/files/big/{f.filename}") for _ in range(20))
                )
                return [r.content for r in responses]

        bodies = asyncio.run(many())
        assert bodies == [body] * 20
        assert upstream.count(f"/packages/{f.filename}") == 1
        text = httpx.get(proxy.url + "/metrics").text
        # 1 page + 20 files, whichever worker answered each.
        assert metric_value(text, "proxy_http_requests_total", repository="pypi") == 21
        assert metric_value(text, "proxy_fetches_in_flight") == 0
    finally:
        proxy.stop()
    assert "Traceback" not in proxy.log()


def test_stats_and_gc_commands(tmp_path: Path, upstream: FakeUpstream) -> None:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha-bytes")])
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    proxy = ProxyProcess(config, tmp_path, "stats").start().wait_ready()
    try:
        assert httpx.get(proxy.url + "/pypi/files/alpha/alpha-1.0.tar.gz").content == b"alpha-bytes"
    finally:
        proxy.stop()
    stats = subprocess.run(
        [sys.executable, "-m", "proxy", "stats", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert stats.returncode == 0, stats.stderr
    [row] = [line.split() for line in stats.stdout.splitlines() if line.startswith("pypi")]
    assert row[:3] == ["pypi", "pypi", "2"]  # the index page and the file
    gc = subprocess.run(
        [sys.executable, "-m", "proxy", "gc", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert gc.returncode == 0 and "purged" in gc.stdout


def test_workers_that_cannot_start_stop_the_server(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("x")
    env = {
        "PROXY_DATABASE_URL": f"sqlite:///{tmp_path / 'ok.db'}",
        "PROXY_STORAGE_PATH": str(not_a_folder),
    }
    process, _url = serve(tmp_path, "--workers", "2", env=env)
    output = process.communicate(timeout=60)[0].decode()
    assert process.returncode == 1, output
    assert "a worker failed to start" in output
    assert output.count("starting another") == 0


def test_ctrl_c_in_a_terminal_stops_workers_cleanly(tmp_path: Path) -> None:
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROXY_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--workers", "2", "--listen", f"127.0.0.1:{port}"],
        cwd=tmp_path, env={**clean, "PYTHONPATH": str(Path.cwd())},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, url)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal does on Ctrl+C
        output = process.communicate(timeout=40)[0].decode()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output
    assert "Traceback" not in output and "did not stop in time" not in output, output

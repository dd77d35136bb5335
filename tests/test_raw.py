"""Raw repositories (proxy/formats/raw.py): any file under the upstream's prefix, with
curl and pip as real clients, and the same miss path, HTTP semantics and leases as the
other formats."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from tests.conftest import ProxyFactory, write_config
from tests.processes import ProxyProcess
from tests.upstream import FakeUpstream, ServerThread, make_sdist

TARBALL = "/releases/v1.2/tool-1.2.tar.gz"


def raw_config(storage: Path, upstream_url: str, database: str = "") -> str:
    return f"""
    [storage]
    path = "{storage}"
    {database}
    [upstream]
    connect_timeout = "2s"
    read_timeout = "5s"
    retries = 0
    [leases]
    ttl = "3s"
    poll_interval = "100ms"
    [[repositories]]
    name = "tools"
    format = "raw"
    upstream = "{upstream_url}/releases/"
    mutable = ["*/latest/*", "*.json"]
    metadata_ttl = "5m"
    negative_ttl = "1m"
    """


@pytest.fixture
def raw_proxy(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> tuple[ServerThread, ManualClock]:
    clock = ManualClock()
    config = write_config(tmp_path, raw_config(tmp_path / "data", upstream.base_url))
    return start_proxy(load(config, {}), clock), clock


def test_a_release_file_is_fetched_once_and_served_with_http_semantics(
    raw_proxy: tuple[ServerThread, ManualClock], upstream: FakeUpstream
) -> None:
    proxy, clock = raw_proxy
    body = gzip.compress(os.urandom(300_000), mtime=0)  # a .tar.gz: gzip data
    upstream.files[TARBALL] = body
    url = proxy.url + "/tools/v1.2/tool-1.2.tar.gz"
    first = httpx.get(url)
    assert first.status_code == 200 and first.content == body
    assert first.headers["content-type"] == "application/gzip"
    clock.advance(365 * 86400)  # immutable: never refetched, however old
    head = httpx.head(url)
    assert head.status_code == 200 and head.headers["content-length"] == str(len(body))
    assert head.headers["etag"] == f'"{hashlib.sha256(body).hexdigest()}"'
    part = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == body[100:200]
    assert httpx.get(url, headers={"If-None-Match": head.headers["etag"]}).status_code == 304
    assert upstream.count(TARBALL) == 1


def test_mutable_paths_are_revalidated_after_metadata_ttl(
    raw_proxy: tuple[ServerThread, ManualClock], upstream: FakeUpstream
) -> None:
    proxy, clock = raw_proxy
    path = "/releases/channel/latest/manifest.txt"
    upstream.files[path] = b"v1"
    url = proxy.url + "/tools/channel/latest/manifest.txt"
    assert httpx.get(url).content == b"v1"
    clock.advance(4 * 60)
    assert httpx.get(url).content == b"v1"
    assert upstream.count(path) == 1  # fresh for metadata_ttl
    clock.advance(2 * 60)
    assert httpx.get(url).content == b"v1"  # revalidated: a 304 keeps the copy
    assert upstream.count(path) == 2
    conditional = [h for m, p, h in upstream.request_headers if p == path][-1]
    assert "if-none-match" in conditional
    upstream.files[path] = b"v2"
    clock.advance(6 * 60)
    assert httpx.get(url).content == b"v2"
    upstream.fault(path, status=503)
    clock.advance(6 * 60)
    stale = httpx.get(url)  # stale-if-error
    assert stale.content == b"v2" and "110" in stale.headers["warning"]


def test_a_path_made_mutable_is_revalidated_though_stored_immutable(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Settings apply to what is stored: a file stored while no `mutable` glob matched
    it, served by a proxy restarted with a glob that does, is revalidated after
    metadata_ttl and no longer told immutable (it was served as stored for ever)."""
    clock = ManualClock()
    path = "/releases/nightly/tool.txt"
    upstream.files[path] = b"v1"
    before = raw_config(tmp_path / "data", upstream.base_url)
    before = before.replace('mutable = ["*/latest/*", "*.json"]', "mutable = []")
    first = start_proxy(load(write_config(tmp_path, before, "before.toml"), {}), clock)
    stored = httpx.get(first.url + "/tools/nightly/tool.txt")
    assert stored.content == b"v1" and "immutable" in stored.headers["cache-control"]
    first.stop()
    after = before.replace("mutable = []", 'mutable = ["nightly/*"]')
    second = start_proxy(load(write_config(tmp_path, after, "after.toml"), {}), clock)
    fresh = httpx.get(second.url + "/tools/nightly/tool.txt")
    assert fresh.content == b"v1" and "immutable" not in fresh.headers["cache-control"]
    assert upstream.count(path) == 1  # fetched 0 s ago: fresh under metadata_ttl
    upstream.files[path] = b"v2"
    clock.advance(6 * 60)  # past metadata_ttl (5m)
    assert httpx.get(second.url + "/tools/nightly/tool.txt").content == b"v2"
    assert upstream.count(path) == 2


def test_misses_folders_and_methods(
    raw_proxy: tuple[ServerThread, ManualClock], upstream: FakeUpstream
) -> None:
    proxy, _clock = raw_proxy
    missing = httpx.get(proxy.url + "/tools/v9/nothing.zip")
    assert missing.status_code == 404
    assert httpx.get(proxy.url + "/tools/v9/nothing.zip").status_code == 404
    assert upstream.count("/releases/v9/nothing.zip") == 1  # remembered for negative_ttl
    assert httpx.get(proxy.url + "/tools/v1.2/").status_code == 404
    assert httpx.put(proxy.url + "/tools/x.bin", content=b"x").status_code == 405
    upstream.fault("/releases/down.bin", status=500)
    outage = httpx.get(proxy.url + "/tools/down.bin")
    assert outage.status_code == 502 and "500" in outage.text  # an outage is never a 404


def test_without_an_upstream_the_answer_names_the_setting(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "tools"
        format = "raw"
        """,
    )
    proxy = start_proxy(load(config, {}))
    response = httpx.get(proxy.url + "/tools/a.tar.gz")
    assert response.status_code == 503
    assert (
        "PROXY_UPSTREAM_TOOLS" in response.text and "repositories.tools.upstream" in response.text
    )


@pytest.mark.slow
def test_curl_and_pip_install_a_tarball(
    raw_proxy: tuple[ServerThread, ManualClock],
    upstream: FakeUpstream,
    tmp_path: Path,
    clean_env: dict[str, str],
) -> None:
    proxy, _clock = raw_proxy
    filename, body = make_sdist("raw-tool", "1.2")
    upstream.files[f"/releases/v1.2/{filename}"] = body
    url = f"{proxy.url}/tools/v1.2/{filename}"
    curl = shutil.which("curl")
    assert curl is not None, "curl is installed by .ci/run"
    fetched = tmp_path / filename
    result = subprocess.run(
        [curl, "-fsS", "-o", str(fetched), "-w", "%{http_code}", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout == "200", result.stderr
    assert fetched.read_bytes() == body
    target = tmp_path / "site"
    result = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--isolated", "--no-index", "--no-cache-dir",
            "--disable-pip-version-check", "--target", str(target), url,
        ],
        capture_output=True, text=True, timeout=300, env=clean_env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (target / "raw_tool.py").read_text() == "VERSION = '1.2'\n"
    assert upstream.count(f"/releases/v1.2/{filename}") == 1


@pytest.mark.slow
@pytest.mark.postgres
def test_two_replicas_fetch_a_raw_file_once(
    tmp_path: Path, upstream: FakeUpstream, pg_url: str
) -> None:
    body = gzip.compress(os.urandom(4 * 1024 * 1024), mtime=0)
    upstream.files[TARBALL] = body
    upstream.fault(TARBALL, chunk_size=256 * 1024, chunk_delay_s=0.1)
    config = write_config(
        tmp_path,
        raw_config(tmp_path / "shared", upstream.base_url, f'[database]\nurl = "{pg_url}"'),
    )
    replicas = [ProxyProcess(config, tmp_path, f"raw-{i}").start() for i in range(2)]
    try:
        for replica in replicas:
            replica.wait_ready()

        async def pull() -> list[bytes]:
            async with httpx.AsyncClient(timeout=60) as client:
                answers = await asyncio.gather(
                    *(
                        client.get(replicas[i % 2].url + "/tools/v1.2/tool-1.2.tar.gz")
                        for i in range(10)
                    )
                )
            return [a.content for a in answers]

        assert asyncio.run(pull()) == [body] * 10
        assert upstream.count(TARBALL) == 1
        waits = sum(r.metric("proxy_fetch_lease_waits_total", repository="tools") for r in replicas)
        assert waits >= 1
    finally:
        for replica in replicas:
            replica.stop()

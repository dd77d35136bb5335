"""The miss path in one process: single flight, streaming, detachment, verification."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.processes import metric_value
from tests.upstream import FakeUpstream, ProjectFile, ServerThread

MiB = 1024 * 1024


def _blob_files(storage: Path) -> list[Path]:
    return [p for p in (storage / "blobs").rglob("*") if p.is_file()]


def _stored(storage: Path, body: bytes) -> bool:
    return hashlib.sha256(body).hexdigest() in {p.name for p in _blob_files(storage)}


def _temp_files(storage: Path) -> list[Path]:
    return [p for p in (storage / "tmp").iterdir() if p.is_file()]


def _add_file(
    upstream: FakeUpstream, size: int, name: str = "big-1.0.tar.gz", **kw: object
) -> ProjectFile:
    body = os.urandom(size)
    f = ProjectFile(name, body, **kw)  # type: ignore[arg-type]
    upstream.add_project("big", [f])
    return f


def _wait_until(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_fifty_concurrent_requests_make_one_upstream_get(
    pypi_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    f = _add_file(upstream, 4 * MiB)
    path = f"/packages/{f.filename}"
    upstream.fault(path, chunk_size=256 * 1024, chunk_delay_s=0.05)
    httpx.get(pypi_proxy.url + "/pypi/simple/big/")

    async def fetch_all() -> list[bytes]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=pypi_proxy.url, timeout=60, limits=limits) as client:

            async def one() -> bytes:
                response = await client.get(f"/pypi/files/big/{f.filename}")
                assert response.status_code == 200
                return response.content

            return await asyncio.gather(*(one() for _ in range(50)))

    bodies = asyncio.run(fetch_all())
    assert upstream.count(path) == 1
    assert len(bodies) == 50
    assert all(body == f.body for body in bodies)
    metrics = httpx.get(pypi_proxy.url + "/metrics").text
    assert 'proxy_coalesced_waiters_total{repository="pypi"}' in metrics


def test_first_bytes_arrive_before_the_download_ends(
    pypi_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    f = _add_file(upstream, 2 * MiB)
    path = f"/packages/{f.filename}"
    upstream.fault(path, chunk_size=128 * 1024, chunk_delay_s=0.2)
    with httpx.stream(
        "GET", f"{pypi_proxy.url}/pypi/files/big/{f.filename}", timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-length"] == str(len(f.body))
        chunks = response.iter_bytes()
        first = next(chunks)
        assert first
        assert upstream.completed[path] == 0, "the first bytes waited for the whole download"
        rest = b"".join(chunks)
    assert first + rest == f.body
    assert upstream.completed[path] == 1


def test_client_leaving_does_not_stop_the_fetch(
    pypi_proxy: ServerThread, upstream: FakeUpstream, tmp_path: Path
) -> None:
    f = _add_file(upstream, 2 * MiB)
    path = f"/packages/{f.filename}"
    upstream.fault(path, chunk_size=128 * 1024, chunk_delay_s=0.1)
    url = f"{pypi_proxy.url}/pypi/files/big/{f.filename}"

    async def scenario() -> bytes:
        async with httpx.AsyncClient(timeout=60) as leaver, httpx.AsyncClient(timeout=60) as stayer:
            staying = asyncio.ensure_future(stayer.get(url))
            async with leaver.stream("GET", url) as response:
                async for _chunk in response.aiter_bytes():
                    break  # read one chunk, then hang up
            response = await staying
            return response.content

    assert asyncio.run(scenario()) == f.body
    _wait_until(lambda: upstream.completed[path] == 1)
    # The stored copy serves the next request without another upstream GET.
    again = httpx.get(url, timeout=30)
    assert again.content == f.body
    assert upstream.count(path) == 1


def test_only_client_leaving_still_stores_the_file(
    pypi_proxy: ServerThread, upstream: FakeUpstream, tmp_path: Path
) -> None:
    f = _add_file(upstream, 1 * MiB)
    path = f"/packages/{f.filename}"
    upstream.fault(path, chunk_size=64 * 1024, chunk_delay_s=0.05)
    url = f"{pypi_proxy.url}/pypi/files/big/{f.filename}"
    with httpx.stream("GET", url, timeout=30) as response:
        next(response.iter_bytes())
    _wait_until(lambda: upstream.completed[path] == 1)
    _wait_until(lambda: _stored(tmp_path / "data", f.body))
    assert httpx.get(url).content == f.body
    assert upstream.count(path) == 1


def test_digest_mismatch_is_502_and_nothing_is_stored(
    pypi_proxy: ServerThread, upstream: FakeUpstream, tmp_path: Path
) -> None:
    f = _add_file(upstream, 10_000, listed_sha256="0" * 64)
    url = f"{pypi_proxy.url}/pypi/files/big/{f.filename}"
    # Metrics are one registry per process, shared by the in-process tests: count deltas.
    before = metric_value(
        httpx.get(pypi_proxy.url + "/metrics").text,
        "proxy_digest_mismatches_total",
        repository="pypi",
    )
    response = httpx.get(url)
    assert response.status_code == 502
    assert "sha256" in response.text
    assert "nothing was stored" in response.text
    assert not _stored(tmp_path / "data", f.body)
    assert _temp_files(tmp_path / "data") == []
    # Not cached: the next request asks the upstream again.
    assert httpx.get(url).status_code == 502
    assert upstream.count(f"/packages/{f.filename}") == 2
    after = metric_value(
        httpx.get(pypi_proxy.url + "/metrics").text,
        "proxy_digest_mismatches_total",
        repository="pypi",
    )
    assert after - before == 2


def test_corrupt_streamed_body_ends_short_and_is_not_stored(
    pypi_proxy: ServerThread, upstream: FakeUpstream, tmp_path: Path
) -> None:
    f = _add_file(upstream, 1 * MiB)
    path = f"/packages/{f.filename}"
    upstream.fault(path, corrupt=True, chunk_size=128 * 1024, chunk_delay_s=0.02)
    url = f"{pypi_proxy.url}/pypi/files/big/{f.filename}"
    received = bytearray()
    with pytest.raises(httpx.RemoteProtocolError), httpx.stream("GET", url, timeout=30) as response:
        assert response.status_code == 200
        for chunk in response.iter_bytes():
            received += chunk
    assert len(received) < len(f.body), "a wrong body was delivered in full"
    assert not _stored(tmp_path / "data", bytes(b ^ 0xFF for b in f.body))
    assert _temp_files(tmp_path / "data") == []
    upstream.clear_faults()
    assert httpx.get(url).content == f.body


def test_truncated_upstream_body_is_never_cached(
    pypi_proxy: ServerThread, upstream: FakeUpstream, tmp_path: Path
) -> None:
    f = _add_file(upstream, 300_000)
    path = f"/packages/{f.filename}"
    upstream.fault(path, truncate_at=100_000, times=1)
    url = f"{pypi_proxy.url}/pypi/files/big/{f.filename}"
    with pytest.raises(httpx.HTTPError):
        response = httpx.get(url, timeout=30)
        assert response.status_code >= 500  # if the error came before the first byte
        raise httpx.RemoteProtocolError("error status")
    assert not _stored(tmp_path / "data", f.body)
    assert _temp_files(tmp_path / "data") == []
    good = httpx.get(url, timeout=30)
    assert good.status_code == 200
    assert good.content == f.body
    assert upstream.count(path) == 2

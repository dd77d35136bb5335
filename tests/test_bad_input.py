"""Bad input gets a clear 4xx, never a 500 or a traceback."""

from __future__ import annotations

import httpx
import pytest

from tests.rawhttp import raw_get
from tests.upstream import FakeUpstream, ProjectFile, ServerThread


@pytest.fixture(autouse=True)
def _project(upstream: FakeUpstream) -> None:
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    upstream.files["/etc/passwd"] = b"root:x:0:0"


@pytest.mark.parametrize(
    "target",
    [
        "/pypi/files/alpha/..%2F..%2Fetc%2Fpasswd",
        "/pypi/files/alpha/%2e%2e/%2e%2e/etc/passwd",
        "/pypi/files/../../etc/passwd",
        "/pypi/files/alpha/./alpha-1.0.tar.gz",
        "/pypi/files/alpha/..%5c..%5cetc",
        "/pypi//simple/alpha/",
        "/pypi/simple//alpha/",
        "/pypi/files/alpha/a%00b",
        "/pypi/files/alpha/%ff%fe",
        "/pypi/files/alpha/a%0Ab",
        "/pypi/simple/a%0D%0A/",
        "/pypi/%0A",
    ],
)
def test_traversal_and_odd_segments_are_400(
    pypi_proxy: ServerThread, upstream: FakeUpstream, target: str
) -> None:
    status, body = raw_get(pypi_proxy.url, target)
    assert status == 400, body
    assert b"not allowed" in body or b"UTF-8" in body or b"empty path segment" in body
    assert upstream.count("/etc/passwd") == 0


def test_over_long_path_is_414(pypi_proxy: ServerThread) -> None:
    status, body = raw_get(pypi_proxy.url, "/pypi/simple/" + "a" * 3000 + "/")
    assert status == 414
    assert b"longer than" in body


def test_over_long_headers_are_431(pypi_proxy: ServerThread) -> None:
    status, body = raw_get(pypi_proxy.url, "/pypi/simple/alpha/", {"X-Big": "b" * 20_000})
    assert status == 431
    assert b"over the" in body


def test_unknown_repository_is_404_naming_the_configured_ones(pypi_proxy: ServerThread) -> None:
    response = httpx.get(pypi_proxy.url + "/npm/left-pad")
    assert response.status_code == 404
    assert "no repository named 'npm'" in response.text
    assert "/pypi/" in response.text


@pytest.mark.parametrize("name", ["-bad", "bad-", "a b", "x" * 300, "über"])
def test_invalid_project_names_are_400(pypi_proxy: ServerThread, name: str) -> None:
    response = httpx.get(pypi_proxy.url + f"/pypi/simple/{name}/")
    assert response.status_code == 400
    assert "not a valid project name" in response.text


def test_file_paths_must_use_normalized_names(pypi_proxy: ServerThread) -> None:
    response = httpx.get(pypi_proxy.url + "/pypi/files/Alpha/alpha-1.0.tar.gz")
    assert response.status_code == 400
    assert "normalized" in response.text


def test_unknown_pypi_paths_are_404(pypi_proxy: ServerThread) -> None:
    for path in ("/pypi/", "/pypi/other", "/pypi/files/alpha", "/pypi/simple/alpha/extra/"):
        response = httpx.get(pypi_proxy.url + path)
        assert response.status_code == 404, path
        assert "a pypi repository serves" in response.text


def test_landing_health_ready(pypi_proxy: ServerThread) -> None:
    landing = httpx.get(pypi_proxy.url + "/")
    assert landing.status_code == 200 and "/pypi/" in landing.text
    assert httpx.get(pypi_proxy.url + "/healthz").text == "ok\n"
    assert httpx.get(pypi_proxy.url + "/readyz").text == "ready\n"

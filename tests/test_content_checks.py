"""Content checks before storing (proxy/fetch/content.py; docs/architecture.md,
"Content checks before storing"): a body no digest verified is stored only if it looks
like what its key holds; a login or error page never becomes an immutable artifact
(issue 18)."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import lzma
from pathlib import Path

import httpx
import pytest

from proxy.config.load import load
from proxy.fetch.content import head_problem, looks_like_html, problem
from proxy.types import Content
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.upstream import FakeUpstream, ProjectFile, zip_bytes

LOGIN_PAGE = (
    b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>Sign in</body></html>"
)
JAR = "/org/example/lib/1.0/lib-1.0.jar"
POM = "/org/example/lib/1.0/lib-1.0.pom"
METADATA = "/org/example/lib/maven-metadata.xml"
VALID_METADATA = b"<metadata><groupId>org.example</groupId><artifactId>lib</artifactId></metadata>"


@pytest.mark.parametrize(
    ("body", "content", "ok"),
    [
        (zip_bytes(b"x"), Content.ZIP, True),
        (zip_bytes(b"x")[:-30], Content.ZIP, False),  # cut short: no end of directory
        (LOGIN_PAGE, Content.ZIP, False),
        (b"PK\x03\x04 but not really", Content.ZIP, False),
        (gzip.compress(b"x", mtime=0), Content.GZIP, True),
        (b"plain text", Content.GZIP, False),
        (gzip.compress(b"x", mtime=0), Content.ARCHIVE, True),
        (bz2.compress(b"x"), Content.ARCHIVE, True),
        (lzma.compress(b"x"), Content.ARCHIVE, True),
        (zip_bytes(b"x"), Content.ARCHIVE, True),
        (b"not an archive", Content.ARCHIVE, False),
        (VALID_METADATA, Content.XML, True),
        (b"<metadata><unclosed></metadata>", Content.XML, False),
        (b"<html><body>x</body></html>", Content.XML, False),  # XHTML: well-formed, a page
        (LOGIN_PAGE, Content.XML, False),
        (b'{"a": [1, 2]}', Content.JSON, True),
        (b"{nope", Content.JSON, False),
        (b"3f786850e387550fdab836ed7e6dc881de23001b\n", Content.TEXT, True),
        (b"\xff\xfe\x00binary", Content.TEXT, False),
        (LOGIN_PAGE, Content.TEXT, False),
        (b"\xef\xbb\xbf  <!-- hi --> <HTML lang=en>", Content.NOT_HTML, False),
        (b"any bytes at all \x00\x01", Content.NOT_HTML, True),
        (LOGIN_PAGE, Content.ANY, True),
    ],
)
def test_each_kind_of_content(tmp_path: Path, body: bytes, content: Content, ok: bool) -> None:
    path = tmp_path / "body"
    path.write_bytes(body)
    assert (problem(str(path), content) is None) == ok, problem(str(path), content)


def test_the_head_check_sees_what_the_first_bytes_show() -> None:
    assert head_problem(LOGIN_PAGE[:100], Content.ZIP) is not None
    assert head_problem(zip_bytes(b"x")[:100], Content.ZIP) is None  # the tail comes later
    assert looks_like_html(b"  <body>") and not looks_like_html(b"<?xml version='1.0'?><a/>")
    assert Content.of_filename("lib-1.0.jar") is Content.ZIP
    assert Content.of_filename("pkg-1.0.tar.gz") is Content.GZIP
    assert Content.of_filename("maven-metadata.xml") is Content.XML
    assert Content.of_filename("index.html") is Content.ANY
    assert Content.of_filename("tool") is Content.NOT_HTML


# -- Maven: a login page for an artifact ------------------------------------------------


def _maven(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory, extra: str = ""
) -> str:
    config = f"""
    [storage]
    path = "{tmp_path / "data"}"
    [upstream]
    retries = 0
    [[repositories]]
    name = "maven"
    format = "maven"
    upstream = "{upstream.base_url}/"
    {extra}
    """
    return start_proxy(load(write_config(tmp_path, config), {})).url + "/maven"


def test_an_upstream_redirecting_to_a_login_page_gets_nothing_stored(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    # Issue 18: the login page was stored as the jar, immutable, with a .sha1 computed
    # from it, so Maven's own check passed.
    upstream.files["/login"] = LOGIN_PAGE
    upstream.content_types["/login"] = "text/html"
    for path in (JAR, JAR + ".sha1", JAR + ".md5", JAR + ".sha256", JAR + ".sha512"):
        upstream.fault(path, redirect_to=upstream.base_url + "/login")
    base = _maven(tmp_path, upstream, start_proxy)
    for _ in range(2):
        response = httpx.get(base + JAR)
        assert response.status_code == 502, response.text
        assert "not a checksum" in response.text or "HTML page" in response.text
    assert httpx.get(base + JAR + ".sha1").status_code == 502  # never computed from it
    assert upstream.count(JAR) == 3  # nothing stored: every request asked again


def test_a_jar_with_no_checksum_anywhere_must_be_a_zip(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    upstream.files[JAR] = LOGIN_PAGE  # answered 200, no sidecars at all (404)
    upstream.files[POM] = b"<project><modelVersion>4.0.0</modelVersion></project>"
    base = _maven(tmp_path, upstream, start_proxy)
    refused = httpx.get(base + JAR)
    assert refused.status_code == 502 and "HTML page" in refused.text
    assert httpx.get(base + POM).status_code == 200  # unverified, but it is a pom
    upstream.files[JAR] = zip_bytes(b"classes")
    assert httpx.get(base + JAR).content == zip_bytes(b"classes")


def test_a_sidecar_that_is_not_a_checksum_stores_nothing(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    # Issue 18: a 200 sidecar that was no checksum counted as absent, so the jar was
    # stored unverified.
    upstream.files[JAR] = zip_bytes(b"classes")
    upstream.files[JAR + ".sha1"] = LOGIN_PAGE
    base = _maven(tmp_path, upstream, start_proxy)
    response = httpx.get(base + JAR)
    assert response.status_code == 502 and "not a checksum" in response.text
    # With a good checksum beside it, a garbled one does no harm (old repositories).
    upstream.files[JAR + ".sha256"] = hashlib.sha256(zip_bytes(b"classes")).hexdigest().encode()
    assert httpx.get(base + JAR).status_code == 200


def test_metadata_that_is_a_login_page_is_refused_even_when_checksums_are_required(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    upstream.files[METADATA] = LOGIN_PAGE
    base = _maven(tmp_path, upstream, start_proxy, 'checksum_policy = "require"')
    response = httpx.get(base + METADATA)
    assert response.status_code == 502 and "HTML page" in response.text
    upstream.files[METADATA] = VALID_METADATA
    assert httpx.get(base + METADATA).content == VALID_METADATA


# -- PyPI and raw: files nothing else verifies --------------------------------------------


def test_a_pypi_file_listed_without_a_hash_must_look_like_its_kind(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    wheel = ProjectFile("pkg-1.0-py3-none-any.whl", LOGIN_PAGE, unhashed=True)
    upstream.add_project("pkg", [wheel])
    config = pypi_config(tmp_path / "data", upstream.base_url)
    url = start_proxy(load(write_config(tmp_path, config), {})).url
    assert httpx.get(url + "/pypi/simple/pkg/").status_code == 200
    response = httpx.get(url + "/pypi/files/pkg/pkg-1.0-py3-none-any.whl")
    assert response.status_code == 502 and "HTML page" in response.text
    assert "content-length" in response.headers  # a clean 502 before any byte, not a cut


def test_a_raw_file_answered_with_an_error_page_is_refused_and_counted(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    upstream.files["/v1/tool-1.0.tar.gz"] = b"<html><body>Internal error</body></html>"
    upstream.files["/docs/index.html"] = b"<html><body>docs</body></html>"
    upstream.files["/v1/big.bin"] = b"x" * 5000
    config = f"""
    [storage]
    path = "{tmp_path / "data"}"
    [[repositories]]
    name = "raw"
    format = "raw"
    upstream = "{upstream.base_url}/"
    max_file_size = "4KB"
    """
    url = start_proxy(load(write_config(tmp_path, config), {})).url + "/raw"
    refused = httpx.get(url + "/v1/tool-1.0.tar.gz")
    assert refused.status_code == 502
    assert "HTML page" in refused.text
    assert httpx.get(url + "/docs/index.html").status_code == 200  # an HTML file may be one
    too_big = httpx.get(url + "/v1/big.bin")
    assert too_big.status_code == 502 and "max_file_size" in too_big.text
    upstream.fault("/v1/big.bin", chunked=True)  # no Content-Length: cut at the limit
    assert httpx.get(url + "/v1/big.bin").status_code == 502
    metrics = httpx.get(url.removesuffix("/raw") + "/metrics").text
    assert 'proxy_content_refused_total{repository="raw"} 1.0' in metrics

"""The PyPI format over real HTTP: pages, negotiation, links, files, faults."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import httpx
import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.processes import metric_value
from tests.upstream import FakeUpstream, ProjectFile, ServerThread, make_wheel

PIP_ACCEPT = (
    "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html; q=0.1, "
    "text/html; q=0.01"
)
UV_ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
JSON_V1 = "application/vnd.pypi.simple.v1+json"


@pytest.fixture
def alpha(upstream: FakeUpstream) -> ProjectFile:
    filename, body, metadata = make_wheel("alpha", "1.0", ["beta"])
    f = ProjectFile(
        filename, body, requires_python=">=3.8,<4", metadata=metadata, yanked="bad build"
    )
    upstream.add_project("alpha", [f])
    return f


def get(proxy: ServerThread, path: str, **kwargs: object) -> httpx.Response:
    return httpx.get(proxy.url + path, timeout=30, **kwargs)  # type: ignore[arg-type]


def test_json_page_for_pip_accept_with_rewritten_relative_links(
    pypi_proxy: ServerThread, alpha: ProjectFile
) -> None:
    response = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": PIP_ACCEPT})
    assert response.status_code == 200
    assert response.headers["content-type"] == JSON_V1
    assert response.headers["vary"] == "Accept"
    data = response.json()
    assert data["name"] == "alpha"
    [item] = data["files"]
    assert item["url"] == f"../../files/alpha/{alpha.filename}"
    assert item["hashes"] == {"sha256": alpha.sha256}
    assert item["requires-python"] == ">=3.8,<4"
    assert item["yanked"] == "bad build"
    assert item["core-metadata"] == {"sha256": hashlib.sha256(alpha.metadata or b"").hexdigest()}
    assert data["meta"]["api-version"] == "1.4"
    assert data["versions"] == ["1.0"]
    # The relative link resolves against the page URL to the proxy's file URL.
    resolved = httpx.URL(pypi_proxy.url + "/pypi/simple/alpha/").join(item["url"])
    assert resolved.path == f"/pypi/files/alpha/{alpha.filename}"


def test_html_page_keeps_attributes_escaped(pypi_proxy: ServerThread, alpha: ProjectFile) -> None:
    response = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": "text/html"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    body = response.text
    digest = hashlib.sha256(alpha.metadata or b"").hexdigest()
    assert f'href="../../files/alpha/{alpha.filename}#sha256={alpha.sha256}"' in body
    assert 'data-requires-python="&gt;=3.8,&lt;4"' in body
    assert 'data-yanked="bad build"' in body
    assert f'data-core-metadata="sha256={digest}"' in body
    assert f'data-dist-info-metadata="sha256={digest}"' in body
    assert f">{alpha.filename}</a>" in body


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (PIP_ACCEPT, JSON_V1),
        (UV_ACCEPT, JSON_V1),
        (None, "text/html; charset=utf-8"),
        ("*/*", "text/html; charset=utf-8"),
        ("application/vnd.pypi.simple.v1+html", "application/vnd.pypi.simple.v1+html"),
        ("application/vnd.pypi.simple.latest+json", JSON_V1),
        ("text/html;q=0.9, application/vnd.pypi.simple.v1+json;q=0.5", "text/html; charset=utf-8"),
    ],
)
def test_accept_negotiation(
    pypi_proxy: ServerThread, alpha: ProjectFile, accept: str | None, expected: str
) -> None:
    headers = {"Accept": accept} if accept is not None else {}
    response = httpx.get(pypi_proxy.url + "/pypi/simple/alpha/", headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == expected


def test_unacceptable_type_is_406(pypi_proxy: ServerThread, alpha: ProjectFile) -> None:
    response = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": "application/json"})
    assert response.status_code == 406
    assert "application/vnd.pypi.simple.v1+json" in response.text


def test_one_stored_page_serves_both_representations(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile
) -> None:
    for accept in ("text/html", JSON_V1) * 3:
        response = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": accept})
        assert response.status_code == 200
        assert alpha.filename in response.text
        assert response.headers["vary"] == "Accept"
    # One upstream request, for JSON (it has the publish times) though HTML came first.
    assert upstream.count("/simple/alpha/") == 1
    accepts = [h.get("accept", "") for m, p, h in upstream.request_headers if p == "/simple/alpha/"]
    assert accepts[0].startswith(JSON_V1)


def test_html_only_upstream_served_as_json_and_json_only_as_html(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile
) -> None:
    upstream.html_only = True
    data = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": JSON_V1}).json()
    assert data["files"][0]["url"] == f"../../files/alpha/{alpha.filename}"
    assert data["files"][0]["hashes"] == {"sha256": alpha.sha256}
    assert data["meta"]["api-version"] == "1.0"  # no sizes/versions from an HTML upstream
    upstream.html_only, upstream.json_only = False, True
    body = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": "text/html"}).text
    assert f"../../files/alpha/{alpha.filename}#sha256={alpha.sha256}" in body


def test_absolute_upstream_links_are_rewritten(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile
) -> None:
    upstream.absolute_links = True
    body = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": "text/html"}).text
    assert upstream.base_url not in body
    response = get(pypi_proxy, f"/pypi/files/alpha/{alpha.filename}")
    assert response.status_code == 200
    assert response.content == alpha.body


def test_name_normalization_and_slash_redirects(
    pypi_proxy: ServerThread, alpha: ProjectFile
) -> None:
    for path in ("/pypi/simple/Alpha/", "/pypi/simple/ALPHA", "/pypi/simple/alpha"):
        response = get(pypi_proxy, path)
        assert response.status_code == 301, path
        assert response.headers["location"] == "/pypi/simple/alpha/"
    response = get(pypi_proxy, "/pypi/simple")
    assert response.status_code == 301
    assert response.headers["location"] == "/pypi/simple/"
    response = get(pypi_proxy, "/pypi/simple/Foo.Bar_baz/")
    assert response.headers["location"] == "/pypi/simple/foo-bar-baz/"


def test_root_index(pypi_proxy: ServerThread, alpha: ProjectFile) -> None:
    html_page = get(pypi_proxy, "/pypi/simple/").text
    assert '<a href="alpha/">alpha</a>' in html_page
    data = get(pypi_proxy, "/pypi/simple/", headers={"Accept": JSON_V1}).json()
    assert data["projects"] == [{"name": "alpha"}]


def test_etag_and_304_for_pages_and_files(pypi_proxy: ServerThread, alpha: ProjectFile) -> None:
    page = get(pypi_proxy, "/pypi/simple/alpha/")
    etag = page.headers["etag"]
    again = get(pypi_proxy, "/pypi/simple/alpha/", headers={"If-None-Match": etag})
    assert again.status_code == 304
    assert again.content == b""
    file = get(pypi_proxy, f"/pypi/files/alpha/{alpha.filename}")
    assert file.headers["etag"] == f'"{alpha.sha256}"'
    assert (
        get(
            pypi_proxy,
            f"/pypi/files/alpha/{alpha.filename}",
            headers={"If-None-Match": file.headers["etag"]},
        ).status_code
        == 304
    )


def test_file_range_if_range_and_head(pypi_proxy: ServerThread, alpha: ProjectFile) -> None:
    path = f"/pypi/files/alpha/{alpha.filename}"
    full = get(pypi_proxy, path)
    assert full.status_code == 200
    assert full.content == alpha.body
    assert full.headers["content-length"] == str(len(alpha.body))
    assert full.headers["accept-ranges"] == "bytes"
    assert "content-encoding" not in full.headers

    part = get(pypi_proxy, path, headers={"Range": "bytes=100-"})
    assert part.status_code == 206
    assert part.content == alpha.body[100:]
    assert part.headers["content-range"] == f"bytes 100-{len(alpha.body) - 1}/{len(alpha.body)}"

    middle = get(pypi_proxy, path, headers={"Range": "bytes=10-19"})
    assert middle.content == alpha.body[10:20]
    suffix = get(pypi_proxy, path, headers={"Range": "bytes=-5"})
    assert suffix.content == alpha.body[-5:]

    matching = get(
        pypi_proxy, path, headers={"Range": "bytes=100-", "If-Range": full.headers["etag"]}
    )
    assert matching.status_code == 206
    changed = get(pypi_proxy, path, headers={"Range": "bytes=100-", "If-Range": '"other"'})
    assert changed.status_code == 200
    assert changed.content == alpha.body

    beyond = get(pypi_proxy, path, headers={"Range": f"bytes={len(alpha.body) + 10}-"})
    assert beyond.status_code == 416
    assert beyond.headers["content-range"] == f"bytes */{len(alpha.body)}"

    head = httpx.head(pypi_proxy.url + path)
    assert head.status_code == 200
    assert head.headers["content-length"] == str(len(alpha.body))
    assert head.content == b""


def test_metadata_sidecar_served_and_verified(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile
) -> None:
    get(pypi_proxy, "/pypi/simple/alpha/")
    response = get(pypi_proxy, f"/pypi/files/alpha/{alpha.filename}.metadata")
    assert response.status_code == 200
    assert response.content == alpha.metadata
    assert (
        hashlib.sha256(response.content).hexdigest()
        == hashlib.sha256(alpha.metadata or b"").hexdigest()
    )
    get(pypi_proxy, f"/pypi/files/alpha/{alpha.filename}.metadata")
    assert upstream.count(f"/packages/{alpha.filename}.metadata") == 1


def test_file_fetch_without_prior_page_fetches_the_page(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile
) -> None:
    response = get(pypi_proxy, f"/pypi/files/alpha/{alpha.filename}")
    assert response.status_code == 200
    assert response.content == alpha.body
    assert upstream.count("/simple/alpha/") == 1


def test_file_never_listed_is_404_and_not_fetched(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile
) -> None:
    upstream.files["/packages/secret.whl"] = b"secret"
    response = get(pypi_proxy, "/pypi/files/alpha/secret.whl")
    assert response.status_code == 404
    assert "not listed" in response.text
    assert upstream.count("/packages/secret.whl") == 0


def test_unknown_project_is_404_and_negative_cached(
    pypi_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    for _ in range(3):
        response = get(pypi_proxy, "/pypi/simple/missing/")
        assert response.status_code == 404
        assert "not found" in response.text
    assert upstream.count("/simple/missing/") == 1


@pytest.mark.parametrize("status", [500, 502, 503])
def test_upstream_5xx_is_never_404(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile, status: int
) -> None:
    upstream.fault("/simple/alpha/", status=status)
    response = get(pypi_proxy, "/pypi/simple/alpha/")
    assert response.status_code in (502, 503)
    assert "upstream" in response.text
    if response.status_code == 503:
        assert "retry-after" in response.headers
    # Retried once (retries = 1 in the test config) and not negative-cached.
    assert upstream.count("/simple/alpha/") == 2
    upstream.clear_faults()
    assert get(pypi_proxy, "/pypi/simple/alpha/").status_code == 200


def test_retry_recovers_from_one_5xx(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile
) -> None:
    upstream.fault("/simple/alpha/", status=503, times=1)
    assert get(pypi_proxy, "/pypi/simple/alpha/").status_code == 200
    assert upstream.count("/simple/alpha/") == 2


def test_upstream_timeout_is_504(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory, alpha: ProjectFile
) -> None:
    config = pypi_config(tmp_path / "data", upstream.base_url).replace(
        'read_timeout = "5s"', 'read_timeout = "300ms"'
    )
    proxy = start_proxy(load(write_config(tmp_path, config), {}))
    upstream.fault("/simple/alpha/", hang=True)
    response = get(proxy, "/pypi/simple/alpha/")
    assert response.status_code == 504
    assert upstream.count("/simple/alpha/") == 1  # a read timeout is not retried


def test_unreachable_upstream_is_502(tmp_path: Path, start_proxy: ProxyFactory) -> None:
    config = pypi_config(tmp_path / "data", "http://127.0.0.1:9")
    proxy = start_proxy(load(write_config(tmp_path, config), {}))
    response = get(proxy, "/pypi/simple/alpha/")
    assert response.status_code == 502
    assert "unreachable" in response.text


def test_stale_if_error_then_revalidation(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory, alpha: ProjectFile
) -> None:
    config = pypi_config(tmp_path / "data", upstream.base_url)
    clock = ManualClock()
    proxy = start_proxy(load(write_config(tmp_path, config), {}), clock)
    first = get(proxy, "/pypi/simple/alpha/")
    assert first.status_code == 200
    # Metrics are one registry per process, shared by the in-process tests: count deltas.
    stale_before = metric_value(
        get(proxy, "/metrics").text, "proxy_stale_served_total", repository="pypi"
    )
    clock.advance(10 * 60)  # metadata_ttl
    upstream.fault("/simple/alpha/", status=500)
    stale = get(proxy, "/pypi/simple/alpha/")
    assert stale.status_code == 200
    assert stale.content == first.content
    assert "110" in stale.headers["warning"]
    upstream.clear_faults()
    # The stale copy is revalidated with the upstream's ETag: a 304 refreshes it.
    fresh = get(proxy, "/pypi/simple/alpha/")
    assert fresh.status_code == 200
    assert "warning" not in fresh.headers
    conditional = [h for m, p, h in upstream.request_headers if p == "/simple/alpha/"][-1]
    assert "if-none-match" in conditional
    stale_after = metric_value(
        get(proxy, "/metrics").text, "proxy_stale_served_total", repository="pypi"
    )
    assert stale_after - stale_before == 1


def test_metadata_ttl_zero_is_never_stored(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory, alpha: ProjectFile
) -> None:
    config = pypi_config(tmp_path / "data", upstream.base_url).replace(
        'metadata_ttl = "10m"', 'metadata_ttl = "0"'
    )
    proxy = start_proxy(load(write_config(tmp_path, config), {}))
    for _ in range(3):
        response = get(proxy, "/pypi/simple/alpha/", headers={"Accept": JSON_V1})
        assert response.status_code == 200
        assert json.loads(response.content)["files"][0]["filename"] == alpha.filename
    assert upstream.count("/simple/alpha/") == 3
    # Links are still recorded, so files stay fetchable.
    assert get(proxy, f"/pypi/files/alpha/{alpha.filename}").content == alpha.body


def test_not_configured_upstream_is_503_naming_the_setting(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "pypi"
        format = "pypi"
    """,
    )
    proxy = start_proxy(load(config, {}))
    response = get(proxy, "/pypi/simple/alpha/")
    assert response.status_code == 503
    assert "repositories.pypi.upstream" in response.text
    assert "PROXY_UPSTREAM_PYPI" in response.text


def test_methods_other_than_get_head_are_405(pypi_proxy: ServerThread) -> None:
    response = httpx.post(pypi_proxy.url + "/pypi/simple/alpha/", content=b"x")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, HEAD"


def test_garbage_in_upstream_pages_is_skipped_not_a_500(
    pypi_proxy: ServerThread, upstream: FakeUpstream, alpha: ProjectFile
) -> None:
    good = json.dumps(
        {
            "meta": {"api-version": "1.1"},
            "name": ["not", "a", "string"],
            "versions": [None, "1.0"],
            "files": [
                {"filename": "bad.whl", "url": "http://[bad/x.whl", "hashes": {}},
                {
                    "filename": "ok-1.0.tar.gz",
                    "url": "ok-1.0.tar.gz",
                    "hashes": {"sha256": "ab\n"},
                    "requires-python": 3,
                    "size": "big",
                },
            ],
        }
    ).encode()
    upstream.files["/simple/weird/"] = good
    for accept in (JSON_V1, "text/html"):
        response = get(pypi_proxy, "/pypi/simple/weird/", headers={"Accept": accept})
        assert response.status_code == 200, response.text
        assert "bad.whl" not in response.text
        assert "ok-1.0.tar.gz" in response.text
    data = get(pypi_proxy, "/pypi/simple/weird/", headers={"Accept": JSON_V1}).json()
    assert data["name"] == "weird"
    assert data["files"][0]["hashes"] == {}
    assert "requires-python" not in data["files"][0]
    html_page = get(pypi_proxy, "/pypi/simple/weird/", headers={"Accept": "text/html"}).text
    assert '<a href="http://[bad' not in html_page


def test_html_escaping_of_names_and_reasons(
    pypi_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    f = ProjectFile('odd-1.0&"<x>.tar.gz', b"odd", yanked='broken <see "issue"> & more')
    upstream.add_project("odd", [f])
    body = get(pypi_proxy, "/pypi/simple/odd/", headers={"Accept": "text/html"}).text
    assert 'data-yanked="broken &lt;see &quot;issue&quot;&gt; &amp; more"' in body
    assert ">odd-1.0&amp;&quot;&lt;x&gt;.tar.gz</a>" in body
    assert 'href="../../files/odd/odd-1.0%26%22%3Cx%3E.tar.gz#sha256=' in body
    response = get(pypi_proxy, "/pypi/files/odd/odd-1.0%26%22%3Cx%3E.tar.gz")
    assert response.status_code == 200 and response.content == b"odd"


def test_a_wildcard_does_not_override_an_explicit_refusal(
    pypi_proxy: ServerThread, alpha: ProjectFile
) -> None:
    response = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": "text/html;q=0, */*"})
    assert response.status_code == 200
    assert not response.headers["content-type"].startswith("text/html")
    refused = get(pypi_proxy, "/pypi/simple/alpha/", headers={"Accept": "application/json"})
    assert refused.headers["vary"] == "Accept"


def test_miss_of_a_chunked_upstream_body_still_has_a_content_length(
    pypi_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = os.urandom(3 * 1024 * 1024)
    f = ProjectFile("chunky-1.0.tar.gz", body)
    upstream.add_project("chunky", [f])
    upstream.fault(
        f"/packages/{f.filename}", chunked=True, chunk_size=256 * 1024, chunk_delay_s=0.01
    )
    for accept in (JSON_V1, "text/html"):  # with and without a size in the index
        get(pypi_proxy, "/pypi/simple/chunky/", headers={"Accept": accept})
    response = get(pypi_proxy, f"/pypi/files/chunky/{f.filename}")
    assert response.status_code == 200
    assert response.headers["content-length"] == str(len(body))
    assert response.content == body


def test_if_modified_since(pypi_proxy: ServerThread, alpha: ProjectFile) -> None:
    path = f"/pypi/files/alpha/{alpha.filename}"
    first = get(pypi_proxy, path)
    same = get(pypi_proxy, path, headers={"If-Modified-Since": first.headers["last-modified"]})
    assert same.status_code == 304
    old = get(pypi_proxy, path, headers={"If-Modified-Since": "Mon, 01 Jan 2001 00:00:00 GMT"})
    assert old.status_code == 200 and old.content == alpha.body

"""The Maven format: path grammar, verified checksums, several upstreams, metadata."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.exceptions import BadRequest
from proxy.formats.maven import parse_checksum, parse_path
from proxy.types import Kind
from tests.conftest import ProxyFactory, write_config
from tests.rawhttp import raw_get
from tests.upstream import FakeUpstream, ServerThread, start_upstream, zip_bytes

JAR = "/org/example/lib/1.0/lib-1.0.jar"
POM = "/org/example/lib/1.0/lib-1.0.pom"
METADATA = "/org/example/lib/maven-metadata.xml"


def publish(
    upstream: FakeUpstream, path: str, body: bytes, checksums: tuple[str, ...] = ("sha1", "md5")
) -> None:
    upstream.files[path] = body
    for algorithm in checksums:
        upstream.files[f"{path}.{algorithm}"] = hashlib.new(algorithm, body).hexdigest().encode()


def maven_config(storage: Path, upstreams: list[str], extra: str = "") -> str:
    urls = ", ".join(f'"{u}/"' for u in upstreams)
    return f"""
    [storage]
    path = "{storage}"
    [upstream]
    connect_timeout = "2s"
    read_timeout = "3s"
    retries = 0
    [[repositories]]
    name = "maven"
    format = "maven"
    upstream = [{urls}]
    metadata_ttl = "30m"
    snapshot_ttl = "1m"
    negative_ttl = "5m"
    {extra}
    """


@pytest.fixture
def second_upstream() -> Iterator[FakeUpstream]:
    fake = FakeUpstream()
    server = start_upstream(fake)
    yield fake
    fake.released.set()
    server.stop()


@pytest.fixture
def maven_proxy(tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory) -> ServerThread:
    config = write_config(tmp_path, maven_config(tmp_path / "data", [upstream.base_url]))
    return start_proxy(load(config, {}))


@pytest.fixture
def two_upstream_proxy(
    tmp_path: Path, upstream: FakeUpstream, second_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> ServerThread:
    config = maven_config(tmp_path / "data", [upstream.base_url, second_upstream.base_url])
    return start_proxy(load(write_config(tmp_path, config), {}))


# -- grammar -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "stored", "checksum", "kind"),
    [
        (
            "org/example/lib/1.0/lib-1.0.jar",
            "org/example/lib/1.0/lib-1.0.jar",
            None,
            Kind.IMMUTABLE,
        ),
        (
            "org/example/lib/1.0/lib-1.0-sources.jar.sha1",
            "org/example/lib/1.0/lib-1.0-sources.jar",
            "sha1",
            Kind.IMMUTABLE,
        ),
        (
            "org/example/lib/1.0/lib-1.0.tar.gz",
            "org/example/lib/1.0/lib-1.0.tar.gz",
            None,
            Kind.IMMUTABLE,
        ),
        (
            "org/example/lib/maven-metadata.xml",
            "org/example/lib/maven-metadata.xml",
            None,
            Kind.METADATA,
        ),
        (
            "org/example/lib/maven-metadata.xml.sha512",
            "org/example/lib/maven-metadata.xml",
            "sha512",
            Kind.METADATA,
        ),
        (
            "org/example/lib/1.0-SNAPSHOT/lib-1.0-SNAPSHOT.jar",
            "org/example/lib/1.0-SNAPSHOT/lib-1.0-SNAPSHOT.jar",
            None,
            Kind.METADATA,
        ),
        (
            "org/example/lib/1.0-SNAPSHOT/lib-1.0-20240101.120000-3.jar",
            "org/example/lib/1.0-SNAPSHOT/lib-1.0-20240101.120000-3.jar",
            None,
            Kind.IMMUTABLE,
        ),
        ("archetype-catalog.xml", "archetype-catalog.xml", None, Kind.METADATA),
    ],
)
def test_path_grammar(path: str, stored: str, checksum: str | None, kind: Kind) -> None:
    parsed = parse_path(path)
    assert (parsed.path, parsed.checksum, parsed.kind) == (stored, checksum, kind)


@pytest.mark.parametrize(
    "path",
    [
        "lib.jar",
        "org/lib-1.0.jar",
        "org/example/lib/1.0/other-1.0.jar",
        "org/example/lib/1.0/lib-2.0.jar",
        "org/example/lib/1.0/.hidden",
        "org/ex ample/lib/1.0/lib-1.0.jar",
        "",
    ],
)
def test_paths_outside_the_grammar_are_rejected(path: str) -> None:
    with pytest.raises(BadRequest):
        parse_path(path)


SHA1 = "a9993e364706816aba3e25717850c26c9cd0d89d"


@pytest.mark.parametrize(
    ("body", "algorithm", "expected"),
    [
        (SHA1.encode(), "sha1", SHA1),
        (SHA1.upper().encode() + b"\n", "sha1", SHA1),
        (f"{SHA1}  lib-1.0.jar\n".encode(), "sha1", SHA1),  # sha1sum's form
        (f"SHA1(lib-1.0.jar)= {SHA1}".encode(), "sha1", SHA1),  # openssl's form
        (f"lib-1.0.jar: {SHA1}".encode(), "sha1", SHA1),
        (b"d41d8cd98f00b204e9800998ecf8427e", "md5", "d41d8cd98f00b204e9800998ecf8427e"),
        (b"", "sha1", None),
        (SHA1[:-1].encode(), "sha1", None),  # one digit short
        (SHA1.encode() + b"0", "sha1", None),  # one digit long
        (SHA1.replace("a", "g").encode(), "sha1", None),  # not hex
        (SHA1.encode(), "md5", None),  # a sha1 where an md5 belongs
        (b"\xff\xfe" + SHA1.encode(), "sha1", None),  # garbage glued to the digest
        (b"<html>404 not found</html>", "sha256", None),
    ],
)
def test_parse_checksum(body: bytes, algorithm: str, expected: str | None) -> None:
    assert parse_checksum(body, algorithm) == expected


@pytest.mark.parametrize(
    "target",
    [
        "/maven/org/example/../../etc/passwd",
        "/maven/org/%2e%2e/lib/1.0/lib-1.0.jar",
        "/maven/org//example/lib/1.0/lib-1.0.jar",
        "/maven/org/example/lib/1.0/lib-2.0.jar",
        "/maven/nothing",
    ],
)
def test_bad_paths_are_400_over_http(
    maven_proxy: ServerThread, upstream: FakeUpstream, target: str
) -> None:
    status, body = raw_get(maven_proxy.url, target)
    assert status == 400, body
    assert sum(upstream.requests.values()) == 0


# -- artifacts and checksums ------------------------------------------------------------


def test_artifact_is_verified_and_checksums_match_the_bytes(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = os.urandom(100_000)
    publish(upstream, JAR, body, ("sha1", "md5", "sha256", "sha512"))
    response = httpx.get(maven_proxy.url + "/maven" + JAR)
    assert response.status_code == 200
    assert response.content == body
    assert response.headers["content-type"] == "application/java-archive"
    # Once stored, responses carry checksums computed from the served bytes.
    stored = httpx.get(maven_proxy.url + "/maven" + JAR)
    assert stored.headers["x-checksum-sha1"] == hashlib.sha1(body).hexdigest()
    assert stored.headers["x-checksum-md5"] == hashlib.md5(body).hexdigest()
    for algorithm in ("sha1", "md5", "sha256", "sha512"):
        checksum = httpx.get(f"{maven_proxy.url}/maven{JAR}.{algorithm}")
        assert checksum.status_code == 200
        assert checksum.text == hashlib.new(algorithm, body).hexdigest()
    # The artifact was fetched once; every upstream checksum file once (to verify).
    assert upstream.count(JAR) == 1
    assert all(upstream.count(f"{JAR}.{a}") == 1 for a in ("sha1", "md5", "sha256", "sha512"))
    # Maven always sends no-cache: it must not force a refetch.
    again = httpx.get(
        maven_proxy.url + "/maven" + JAR,
        headers={"Cache-Control": "no-cache", "Pragma": "no-cache"},
    )
    assert again.content == body
    assert upstream.count(JAR) == 1


def test_checksum_mismatch_is_502_and_nothing_is_stored(
    maven_proxy: ServerThread, upstream: FakeUpstream, tmp_path: Path
) -> None:
    body = os.urandom(10_000)
    publish(upstream, JAR, body)
    upstream.files[JAR + ".sha1"] = b"0" * 40
    response = httpx.get(maven_proxy.url + "/maven" + JAR)
    assert response.status_code == 502
    assert "sha1" in response.text and "nothing was stored" in response.text
    assert hashlib.sha256(body).hexdigest() not in {p.name for p in (tmp_path / "data").rglob("*")}
    assert httpx.get(maven_proxy.url + "/maven" + JAR).status_code == 502
    assert upstream.count(JAR) == 2  # not cached
    assert httpx.get(maven_proxy.url + "/maven" + JAR + ".sha1").status_code == 502


def test_checksum_file_formats_are_understood(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = b"<project/>"
    upstream.files[POM] = body
    upstream.files[POM + ".sha1"] = (
        f"{hashlib.sha1(body).hexdigest().upper()}  lib-1.0.pom\n".encode()
    )
    upstream.files[POM + ".md5"] = f"MD5 (lib-1.0.pom) = {hashlib.md5(body).hexdigest()}\n".encode()
    response = httpx.get(maven_proxy.url + "/maven" + POM)
    assert response.status_code == 200 and response.content == body
    assert response.headers["content-type"] == "text/xml"


def test_checksum_request_first_fetches_the_artifact(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = os.urandom(5000)
    publish(upstream, JAR, body)
    checksum = httpx.get(f"{maven_proxy.url}/maven{JAR}.sha1")
    assert checksum.text == hashlib.sha1(body).hexdigest()
    assert httpx.get(maven_proxy.url + "/maven" + JAR).content == body
    assert upstream.count(JAR) == 1


def test_missing_artifact_is_404_and_negative_cached(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    for _ in range(3):
        response = httpx.get(maven_proxy.url + "/maven" + JAR)
        assert response.status_code == 404
    assert upstream.count(JAR) == 1
    assert httpx.get(f"{maven_proxy.url}/maven{JAR}.sha1").status_code == 404


@pytest.mark.parametrize("status", [500, 503])
def test_outage_is_never_404(
    maven_proxy: ServerThread, upstream: FakeUpstream, status: int
) -> None:
    publish(upstream, JAR, b"jar")
    upstream.fault(JAR, status=status)
    response = httpx.get(maven_proxy.url + "/maven" + JAR)
    assert response.status_code == (503 if status == 503 else 502)
    if status == 503:
        assert response.headers["retry-after"].isdigit()


def test_fifty_concurrent_requests_make_one_upstream_get(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = os.urandom(3 * 1024 * 1024)
    publish(upstream, JAR, body)
    upstream.fault(JAR, chunk_size=256 * 1024, chunk_delay_s=0.05)

    async def all_at_once() -> list[bytes]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=60)) as client:
            responses = await asyncio.gather(
                *(client.get(maven_proxy.url + "/maven" + JAR) for _ in range(50))
            )
            assert {r.status_code for r in responses} == {200}
            return [r.content for r in responses]

    assert asyncio.run(all_at_once()) == [body] * 50
    assert upstream.count(JAR) == 1


def _upstream_requests(upstream: FakeUpstream, since: int) -> list[tuple[str, str]]:
    return [(method, path) for method, path, _headers in upstream.request_headers[since:]]


def test_a_head_miss_makes_exactly_the_upstream_requests_a_get_miss_makes(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Freshness is the engine's: a HEAD for an uncached artifact goes the miss path of
    a GET (single flight, lease, verification, negative entries), never straight to the
    upstream, and answers from the entry it stores."""
    body = os.urandom(50_000)
    publish(upstream, JAR, body)
    proxies = []
    for name in ("by-get", "by-head"):
        config = write_config(
            tmp_path, maven_config(tmp_path / name, [upstream.base_url]), f"{name}.toml"
        )
        proxies.append(start_proxy(load(config, {})))
    by_get, by_head = proxies
    start = len(upstream.request_headers)
    got = httpx.get(by_get.url + "/maven" + JAR)
    assert got.status_code == 200 and got.content == body
    after_get = len(upstream.request_headers)
    head = httpx.head(by_head.url + "/maven" + JAR)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(len(body))
    get_requests = sorted(_upstream_requests(upstream, start)[: after_get - start])
    head_requests = sorted(_upstream_requests(upstream, after_get))
    assert head_requests == get_requests
    assert ("GET", JAR) in head_requests and all(m == "GET" for m, _ in head_requests)
    # The HEAD stored the file: a GET and another HEAD are hits.
    assert httpx.get(by_head.url + "/maven" + JAR).content == body
    cached = httpx.head(by_head.url + "/maven" + JAR)
    assert cached.headers["etag"] == got.headers["etag"]
    assert cached.headers["x-checksum-sha1"] == hashlib.sha1(body).hexdigest()
    assert upstream.count(JAR) == 2 and upstream.count(JAR, "HEAD") == 0
    # A miss confirmed upstream is a negative entry, whichever method found it.
    absent = "/org/example/lib/1.0/lib-1.0-absent.jar"
    assert httpx.head(by_head.url + "/maven" + absent).status_code == 404
    assert httpx.head(by_head.url + "/maven" + absent).status_code == 404
    assert httpx.get(by_head.url + "/maven" + absent).status_code == 404
    assert upstream.count(absent) == 1 and upstream.count(absent, "HEAD") == 0


def test_heads_and_gets_of_one_miss_share_one_fetch(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = os.urandom(2_000_000)
    publish(upstream, JAR, body)
    upstream.fault(JAR, chunk_size=64 * 1024, chunk_delay_s=0.01)

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            url = maven_proxy.url + "/maven" + JAR
            return await asyncio.gather(
                *(client.request("HEAD" if i % 2 else "GET", url) for i in range(10))
            )

    answers = asyncio.run(together())
    assert {a.status_code for a in answers} == {200}
    assert {a.headers["content-length"] for a in answers} == {str(len(body))}
    assert [a.content for a in answers if a.request.method == "GET"] == [body] * 5
    assert upstream.count(JAR) == 1 and upstream.count(JAR, "HEAD") == 0


def test_a_head_miss_whose_upstream_states_no_length_answers_the_real_length(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    """A body of unknown length is read to its end before the answer (never a
    "Content-Length: 0")."""
    body = os.urandom(50_000)
    publish(upstream, JAR, body)
    upstream.fault(JAR, chunked=True)
    head = httpx.head(maven_proxy.url + "/maven" + JAR)
    assert head.status_code == 200
    assert head.headers["content-length"] == str(len(body))
    assert upstream.count(JAR, "HEAD") == 0 and upstream.count(JAR) == 1


def test_range_resume_with_if_unmodified_since(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = os.urandom(40_000)
    publish(upstream, JAR, body)
    full = httpx.get(maven_proxy.url + "/maven" + JAR)
    resumed = httpx.get(
        maven_proxy.url + "/maven" + JAR,
        headers={"Range": "bytes=1000-", "If-Unmodified-Since": full.headers["last-modified"]},
    )
    assert resumed.status_code == 206 and resumed.content == body[1000:]
    old = httpx.get(
        maven_proxy.url + "/maven" + JAR,
        headers={"Range": "bytes=1000-", "If-Unmodified-Since": "Mon, 01 Jan 2001 00:00:00 GMT"},
    )
    assert old.status_code == 412


def test_puts_are_refused(maven_proxy: ServerThread) -> None:
    response = httpx.put(maven_proxy.url + "/maven" + JAR, content=b"x")
    assert response.status_code == 405


# -- metadata ----------------------------------------------------------------------------


def test_metadata_checksums_follow_the_bytes_served(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    config = maven_config(tmp_path / "data", [upstream.base_url])
    clock = ManualClock()
    proxy = start_proxy(load(write_config(tmp_path, config), {}), clock)
    first = b"<metadata><versioning><latest>1.0</latest></versioning></metadata>"
    publish(upstream, METADATA, first)
    assert httpx.get(proxy.url + "/maven" + METADATA).content == first
    # Upstream publishes a new version; its checksum file changes with it.
    second = first.replace(b"1.0", b"1.1")
    publish(upstream, METADATA, second)
    assert httpx.get(f"{proxy.url}/maven{METADATA}.sha1").text == hashlib.sha1(first).hexdigest()
    clock.advance(30 * 60)  # metadata_ttl
    assert httpx.get(proxy.url + "/maven" + METADATA).content == second
    assert httpx.get(f"{proxy.url}/maven{METADATA}.sha1").text == hashlib.sha1(second).hexdigest()
    # Stale copy on outage, with its matching checksum.
    clock.advance(30 * 60)
    upstream.fault(METADATA, status=502)
    stale = httpx.get(proxy.url + "/maven" + METADATA)
    assert (
        stale.status_code == 200 and stale.content == second and "110" in stale.headers["warning"]
    )


def test_snapshot_files_use_the_snapshot_ttl(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    config = maven_config(tmp_path / "data", [upstream.base_url])
    clock = ManualClock()
    proxy = start_proxy(load(write_config(tmp_path, config), {}), clock)
    snapshot = "/org/example/lib/1.0-SNAPSHOT/lib-1.0-SNAPSHOT.jar"
    publish(upstream, snapshot, zip_bytes(b"v1"))
    publish(upstream, METADATA, b"<metadata/>")
    assert httpx.get(proxy.url + "/maven" + snapshot).content == zip_bytes(b"v1")
    httpx.get(proxy.url + "/maven" + METADATA)
    publish(upstream, snapshot, zip_bytes(b"v2"))
    clock.advance(61)  # past snapshot_ttl (1m), well within metadata_ttl (30m)
    assert httpx.get(proxy.url + "/maven" + snapshot).content == zip_bytes(b"v2")
    httpx.get(proxy.url + "/maven" + METADATA)
    assert upstream.count(METADATA) == 1  # release metadata keeps its 30m TTL


# -- several upstreams ----------------------------------------------------------------------


def test_upstreams_are_tried_in_order(
    two_upstream_proxy: ServerThread, upstream: FakeUpstream, second_upstream: FakeUpstream
) -> None:
    publish(second_upstream, JAR, b"from-second")
    assert httpx.get(two_upstream_proxy.url + "/maven" + JAR).content == b"from-second"
    assert upstream.count(JAR) == 1 and second_upstream.count(JAR) == 1
    publish(upstream, POM, b"<first/>")
    publish(second_upstream, POM, b"<second/>")
    assert httpx.get(two_upstream_proxy.url + "/maven" + POM).content == b"<first/>"
    assert second_upstream.count(POM) == 0


def test_404_only_when_every_upstream_confirmed_the_miss(
    two_upstream_proxy: ServerThread, upstream: FakeUpstream, second_upstream: FakeUpstream
) -> None:
    upstream.fault(JAR, status=500)
    response = httpx.get(two_upstream_proxy.url + "/maven" + JAR)
    assert response.status_code == 502, "one upstream's outage must not look like a miss"
    upstream.clear_faults()
    assert httpx.get(two_upstream_proxy.url + "/maven" + JAR).status_code == 404


def test_redirects_are_followed_and_cached_under_the_original_path(
    two_upstream_proxy: ServerThread, upstream: FakeUpstream, second_upstream: FakeUpstream
) -> None:
    body = os.urandom(2000)
    second_upstream.files["/cdn/blob-123"] = body
    upstream.files[JAR] = b""  # placeholder so the fault applies to a known path
    upstream.fault(JAR, redirect_to=f"{second_upstream.base_url}/cdn/blob-123")
    upstream.files[JAR + ".sha1"] = hashlib.sha1(body).hexdigest().encode()
    response = httpx.get(two_upstream_proxy.url + "/maven" + JAR)
    assert response.status_code == 200 and response.content == body
    assert httpx.get(two_upstream_proxy.url + "/maven" + JAR).content == body
    assert second_upstream.count("/cdn/blob-123") == 1


def test_prefixes_file_of_one_upstream_is_not_passed_through(
    two_upstream_proxy: ServerThread,
    maven_proxy: ServerThread,
    upstream: FakeUpstream,
    second_upstream: FakeUpstream,
) -> None:
    upstream.files["/.meta/prefixes.txt"] = b"## repository-prefixes/2.0\n/org/example\n"
    response = httpx.get(two_upstream_proxy.url + "/maven/.meta/prefixes.txt")
    assert response.status_code == 404
    assert upstream.count("/.meta/prefixes.txt") == 0
    single = httpx.get(maven_proxy.url + "/maven/.meta/prefixes.txt")
    assert single.status_code == 200 and b"/org/example" in single.content


def test_verification_uses_the_strongest_usable_upstream_checksum(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    body = os.urandom(20_000)
    publish(upstream, JAR, body, ("sha1",))
    upstream.files[JAR + ".md5"] = b"0" * 32  # a wrong weaker checksum beside a good one
    upstream.files[JAR + ".sha512"] = b"<html>not a checksum</html>"  # garbled: ignored
    upstream.fault(JAR + ".sha256", status=500)  # unavailable: ignored
    response = httpx.get(maven_proxy.url + "/maven" + JAR)
    assert response.status_code == 200 and response.content == body
    # The strongest usable one decides: a wrong sha256 fails even beside a good sha1.
    other = "/org/example/lib/1.0/lib-1.0-tests.jar"
    publish(upstream, other, body, ("sha1",))
    upstream.files[other + ".sha256"] = b"f" * 64
    assert httpx.get(maven_proxy.url + "/maven" + other).status_code == 502


def test_metadata_checksum_never_refreshes_the_metadata(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    config = maven_config(tmp_path / "data", [upstream.base_url])
    clock = ManualClock()
    proxy = start_proxy(load(write_config(tmp_path, config), {}), clock)
    first = b"<metadata><version>1.0</version></metadata>"
    publish(upstream, METADATA, first)
    assert httpx.get(proxy.url + "/maven" + METADATA).content == first
    clock.advance(31 * 60)
    publish(upstream, METADATA, first.replace(b"1.0", b"2.0"))
    # The client holds the first bytes: their checksum, not the new file's.
    assert httpx.get(f"{proxy.url}/maven{METADATA}.sha1").text == hashlib.sha1(first).hexdigest()
    assert upstream.count(METADATA) == 1


def test_retry_after_of_an_upstream_is_passed_on(
    maven_proxy: ServerThread, upstream: FakeUpstream
) -> None:
    upstream.fault(JAR, status=429, retry_after="30")
    response = httpx.get(maven_proxy.url + "/maven" + JAR)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "30"

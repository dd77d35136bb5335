"""Every format's unit tests, in memory: the whole app (engine, format, error table) on
proxy/testing's MemoryCatalog and MockUpstream, called through ASGI with no socket,
no server thread and no database. The over-HTTP tests of each format (test_pypi.py,
test_maven.py...) check the same behaviour with real clients and real servers."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.config.settings import Settings
from proxy.exceptions import UpstreamBusy, UpstreamUnavailable
from proxy.testing import Handler, InMemoryProxy, MockResponse, UpstreamRequest, static_upstream
from proxy.types import Kind
from tests.conftest import write_config

pytestmark = pytest.mark.anyio

JSON_V1 = "application/vnd.pypi.simple.v1+json"
INDEX = "https://upstream.example/simple/"
M2 = "https://upstream.example/m2/"
MIRROR = "https://mirror.example/m2/"
FILES = "https://upstream.example/files/"

TOOL = gzip.compress(b"tool", mtime=0)  # a .tar.gz must be gzip data to be stored


@asynccontextmanager
async def proxy(
    tmp_path: Path,
    handler: Handler,
    repositories: str,
    clock: ManualClock | None = None,
) -> AsyncIterator[InMemoryProxy]:
    async with InMemoryProxy(
        settings(tmp_path, repositories), handler, clock or ManualClock()
    ) as running:
        yield running


def settings(folder: Path, repositories: str) -> Settings:
    folder.mkdir(parents=True, exist_ok=True)
    config = write_config(folder, f'[storage]\npath = "{folder / "data"}"\n{repositories}')
    return load(config, {})


# -- pypi ------------------------------------------------------------------------------------

WHEEL = b"PK\x03\x04 a wheel"
METADATA = b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
PYPI = f"""
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{INDEX}"
metadata_ttl = "10m"
negative_ttl = "1m"
"""


def project_page(listed_sha256: str | None = None) -> bytes:
    return json.dumps(
        {
            "meta": {"api-version": "1.1"},
            "name": "demo",
            "files": [
                {
                    "filename": "demo-1.0-py3-none-any.whl",
                    "url": "https://files.example/demo-1.0-py3-none-any.whl",
                    "hashes": {"sha256": listed_sha256 or hashlib.sha256(WHEEL).hexdigest()},
                    "core-metadata": {"sha256": hashlib.sha256(METADATA).hexdigest()},
                }
            ],
        }
    ).encode()


def pypi_upstream(page: bytes) -> Callable[[UpstreamRequest], MockResponse]:
    return static_upstream(
        {
            INDEX + "demo/": MockResponse(200, page, {"content-type": JSON_V1, "etag": '"p1"'}),
            "https://files.example/demo-1.0-py3-none-any.whl": WHEEL,
            "https://files.example/demo-1.0-py3-none-any.whl.metadata": METADATA,
        }
    )


async def test_pypi_page_links_and_files(tmp_path: Path) -> None:
    async with proxy(tmp_path, pypi_upstream(project_page()), PYPI) as p:
        page = await p.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})
        assert page.status_code == 200 and page.headers["vary"] == "Accept"
        [listed] = page.json()["files"]
        assert listed["url"] == "../../files/demo/demo-1.0-py3-none-any.whl"
        assert p.upstream.requests[0].headers["accept"].startswith(JSON_V1)
        wheel = await p.client.get("/pypi/files/demo/demo-1.0-py3-none-any.whl")
        assert (
            wheel.content == WHEEL
            and wheel.headers["etag"] == f'"{hashlib.sha256(WHEEL).hexdigest()}"'
        )
        sidecar = await p.client.get("/pypi/files/demo/demo-1.0-py3-none-any.whl.metadata")
        assert sidecar.content == METADATA
        again = await p.client.get("/pypi/files/demo/demo-1.0-py3-none-any.whl")
        assert again.content == WHEEL
        assert p.upstream.count("https://files.example/demo-1.0-py3-none-any.whl") == 1
        assert (await p.client.get("/pypi/simple/Demo")).headers["location"] == "/pypi/simple/demo/"


async def test_pypi_file_only_from_a_listed_url(tmp_path: Path) -> None:
    async with proxy(tmp_path, pypi_upstream(project_page()), PYPI) as p:
        # Not listed: the project page is fetched (a file needs its page), never the file.
        missing = await p.client.get("/pypi/files/demo/demo-9.9.tar.gz")
        assert missing.status_code == 404 and "not listed" in missing.text
        assert [r.url for r in p.upstream.requests] == [INDEX + "demo/"]


async def test_pypi_a_file_whose_digest_does_not_match_is_refused_and_not_stored(
    tmp_path: Path,
) -> None:
    async with proxy(tmp_path, pypi_upstream(project_page("0" * 64)), PYPI) as p:
        for _ in range(2):
            refused = await p.client.get("/pypi/files/demo/demo-1.0-py3-none-any.whl")
            assert refused.status_code == 502 and "nothing was stored" in refused.text
        assert ("pypi", "files/demo/demo-1.0-py3-none-any.whl") not in p.catalog.entries
        assert p.upstream.count("https://files.example/demo-1.0-py3-none-any.whl") == 2
        assert p.catalog.leases["pypi/files/demo/demo-1.0-py3-none-any.whl"].state == "failed"


async def test_pypi_stale_page_when_the_upstream_fails_then_revalidated(tmp_path: Path) -> None:
    clock = ManualClock()
    failing = False

    def handler(request: UpstreamRequest) -> MockResponse:
        if failing:
            raise UpstreamUnavailable("upstream answered 500")
        if request.headers.get("if-none-match") == '"p1"':
            return MockResponse(304, b"", {"etag": '"p1"'})
        return pypi_upstream(project_page())(request)

    async with proxy(tmp_path, handler, PYPI, clock) as p:
        fresh = await p.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})
        assert fresh.headers["cache-control"] == "public, max-age=600"
        clock.advance(601)
        failing = True
        stale = await p.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})
        assert stale.status_code == 200 and stale.json() == fresh.json()
        assert stale.headers["warning"] == '110 - "Response is Stale"'
        failing = False
        revalidated = await p.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})
        assert "warning" not in revalidated.headers
        assert p.upstream.requests[-1].headers["if-none-match"] == '"p1"'


async def test_pypi_a_confirmed_miss_is_a_negative_entry_for_its_ttl(tmp_path: Path) -> None:
    clock = ManualClock()
    async with proxy(tmp_path, static_upstream({}), PYPI, clock) as p:
        for _ in range(3):
            assert (await p.client.get("/pypi/simple/absent/")).status_code == 404
        assert p.upstream.count(INDEX + "absent/") == 1
        assert p.catalog.entries[("pypi", "simple/absent/")].kind is Kind.NEGATIVE
        clock.advance(61)
        assert (await p.client.get("/pypi/simple/absent/")).status_code == 404
        assert p.upstream.count(INDEX + "absent/") == 2


async def test_pypi_an_outage_is_never_a_404(tmp_path: Path) -> None:
    def handler(request: UpstreamRequest) -> MockResponse:
        raise UpstreamBusy("upstream answered 429", retry_after_s=9)

    async with proxy(tmp_path, handler, PYPI) as p:
        busy = await p.client.get("/pypi/simple/demo/")
        assert (busy.status_code, busy.headers["retry-after"]) == (503, "9")
        assert ("pypi", "simple/demo/") not in p.catalog.entries


# -- maven -----------------------------------------------------------------------------------

JAR_PATH = "org/example/lib/1.0/lib-1.0.jar"
JAR = b"\xca\xfe\xba\xbe a jar"
MAVEN = f"""
[[repositories]]
name = "maven"
format = "maven"
upstream = ["{M2}", "{MIRROR}"]
metadata_ttl = "30m"
"""


def jar_files(base: str, body: bytes = JAR, sha1: str | None = None) -> dict[str, bytes]:
    return {
        base + JAR_PATH: body,
        base + JAR_PATH + ".sha1": (sha1 or hashlib.sha1(body).hexdigest()).encode(),
    }


async def test_maven_checksums_are_computed_from_the_bytes_served(tmp_path: Path) -> None:
    async with proxy(tmp_path, static_upstream(jar_files(M2)), MAVEN) as p:
        jar = await p.client.get(f"/maven/{JAR_PATH}")
        assert jar.content == JAR
        sha1 = await p.client.get(f"/maven/{JAR_PATH}.sha1")
        assert sha1.text == hashlib.sha1(JAR).hexdigest()
        md5 = await p.client.get(f"/maven/{JAR_PATH}.md5")  # the upstream has none: computed
        assert md5.text == hashlib.md5(JAR).hexdigest()
        again = await p.client.get(f"/maven/{JAR_PATH}")
        assert again.headers["x-checksum-sha1"] == hashlib.sha1(JAR).hexdigest()
        assert again.headers["x-checksum-md5"] == hashlib.md5(JAR).hexdigest()
        assert p.upstream.count(M2 + JAR_PATH) == 1


async def test_maven_an_artifact_that_does_not_match_its_checksum_is_refused(
    tmp_path: Path,
) -> None:
    async with proxy(tmp_path, static_upstream(jar_files(M2, sha1="1" * 40)), MAVEN) as p:
        refused = await p.client.get(f"/maven/{JAR_PATH}")
        assert refused.status_code == 502 and "sha1" in refused.text
        assert ("maven", JAR_PATH) not in p.catalog.entries


async def test_maven_upstreams_in_order_and_404_only_when_all_missed(tmp_path: Path) -> None:
    async with proxy(tmp_path, static_upstream(jar_files(MIRROR)), MAVEN) as p:
        assert (await p.client.get(f"/maven/{JAR_PATH}")).content == JAR
        assert [r.url for r in p.upstream.requests[:2]] == [M2 + JAR_PATH, MIRROR + JAR_PATH]
        assert (await p.client.get("/maven/org/example/lib/1.0/lib-1.0.pom")).status_code == 404

    def half_down(request: UpstreamRequest) -> MockResponse:
        if request.url.startswith(M2):
            raise UpstreamUnavailable("connection refused")
        return MockResponse(404, b"")

    async with proxy(tmp_path / "b", half_down, MAVEN) as p:
        outage = await p.client.get(f"/maven/{JAR_PATH}")
        assert outage.status_code == 502 and "no upstream could answer" in outage.text


async def test_maven_a_head_miss_asks_the_upstream_what_a_get_miss_asks(tmp_path: Path) -> None:
    async with proxy(tmp_path / "get", static_upstream(jar_files(M2)), MAVEN) as by_get:
        assert (await by_get.client.get(f"/maven/{JAR_PATH}")).status_code == 200
    async with proxy(tmp_path / "head", static_upstream(jar_files(M2)), MAVEN) as by_head:
        head = await by_head.client.head(f"/maven/{JAR_PATH}")
        assert (head.status_code, head.headers["content-length"]) == (200, str(len(JAR)))
        assert sorted((r.method, r.url) for r in by_head.upstream.requests) == sorted(
            (r.method, r.url) for r in by_get.upstream.requests
        )
        assert ("maven", JAR_PATH) in by_head.catalog.entries


async def test_maven_metadata_is_revalidated_after_its_ttl(tmp_path: Path) -> None:
    clock = ManualClock()
    metadata = b"<metadata><versioning><release>1.0</release></versioning></metadata>"

    def handler(request: UpstreamRequest) -> MockResponse:
        if request.url.endswith(".xml") and request.url.startswith(M2):
            if request.headers.get("if-none-match") == '"m1"':
                return MockResponse(304, b"", {"etag": '"m1"'})
            return MockResponse(200, metadata, {"etag": '"m1"'})
        return MockResponse(404, b"")

    one = MAVEN.replace(f', "{MIRROR}"', "")
    async with proxy(tmp_path, handler, one, clock) as p:
        path = "/maven/org/example/lib/maven-metadata.xml"
        assert (await p.client.get(path)).content == metadata
        clock.advance(1801)
        assert (await p.client.get(path)).content == metadata
        assert p.upstream.requests[-1].headers["if-none-match"] == '"m1"'
        assert len(p.upstream.requests) == 2


# -- raw ---------------------------------------------------------------------------------------

RAW = f"""
[[repositories]]
name = "raw"
format = "raw"
upstream = "{FILES}"
mutable = ["*/latest/*"]
metadata_ttl = "1m"
"""


async def test_raw_paths_are_quoted_and_immutable_unless_mutable(tmp_path: Path) -> None:
    clock = ManualClock()
    files: dict[str, bytes | MockResponse] = {
        FILES + "v1/tool%201+2.tar.gz": TOOL,  # "+" is a pchar: kept as is
        FILES + "v1/latest/tool.json": MockResponse(200, b"{}", {"etag": '"1"'}),
    }
    async with proxy(tmp_path, static_upstream(files), RAW, clock) as p:
        tarball = await p.client.get("/raw/v1/tool%201%2B2.tar.gz")
        assert tarball.content == TOOL and tarball.headers["content-type"] == "application/gzip"
        assert tarball.headers["cache-control"] == "public, max-age=31536000, immutable"
        latest = await p.client.get("/raw/v1/latest/tool.json")
        assert latest.headers["cache-control"] == "public, max-age=60"
        clock.advance(61)
        await p.client.get("/raw/v1/tool%201%2B2.tar.gz")
        await p.client.get("/raw/v1/latest/tool.json")
        assert p.upstream.count(FILES + "v1/tool%201+2.tar.gz") == 1
        assert p.upstream.count(FILES + "v1/latest/tool.json") == 2
        assert (await p.client.get("/raw/v1/")).status_code == 404  # a folder
        assert (await p.client.get("/raw/v1/a%2Fb")).status_code == 400


# -- the gradle build cache -----------------------------------------------------------------

CACHE = """
[[repositories]]
name = "cache"
format = "gradle-build-cache"
max_entry_size = "1KB"
anonymous = "read"
[repositories.users.ci]
password = "secret"
role = "write"
"""


async def test_build_cache_uploads_auth_and_limits(tmp_path: Path) -> None:
    async with proxy(tmp_path, static_upstream({}), CACHE) as p:
        assert (await p.client.get("/cache/k1")).status_code == 404
        refused = await p.client.put("/cache/k1", content=b"x")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith(
            "Basic"
        )
        stored = await p.client.put("/cache/k1", content=b"entry", auth=("ci", "secret"))
        assert stored.status_code == 201
        assert (await p.client.get("/cache/k1")).content == b"entry"
        head = await p.client.head("/cache/k1")
        assert (head.status_code, head.headers["content-length"]) == (200, "5")
        too_big = await p.client.put("/cache/k2", content=b"x" * 2000, auth=("ci", "secret"))
        assert too_big.status_code == 413
        assert p.catalog.entries[("cache", "k1")].kind is Kind.HOSTED
        assert ("cache", "k2") not in p.catalog.entries
        assert (await p.client.post("/cache/k1")).headers["allow"] == "GET, HEAD, PUT"
        assert p.upstream.requests == []

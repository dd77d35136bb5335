"""Stored bodies that name the proxy (contract.BASE_URL_MARK, FetchSpec.base_url_marks):
stored once in a neutral form, served with the absolute URL of each request filled in,
so no client's Host header changes what another client gets. In memory (proxy/testing),
with a format of the test's own."""

from __future__ import annotations

import sys
import types
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy import formats
from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.contract import (
    BASE_URL_MARK,
    Duration,
    Fetched,
    FetchSpec,
    FormatPlugin,
    Kind,
    OriginContext,
    ProxyContext,
    Proxying,
    RepositorySettings,
    Request,
    Response,
    Status,
    UpstreamUnavailable,
    Validators,
    option,
)
from proxy.testing import InMemoryProxy, MockResponse, UpstreamRequest
from tests.conftest import write_config

pytestmark = pytest.mark.anyio

UPSTREAM = "https://upstream.example/pages/"


@dataclass(frozen=True)
class PageOptions:
    ttl_s: float = option(Duration(), 60.0, key="ttl")


class PageOrigin:
    """Stores the upstream text with each "@@" turned into a base-URL mark."""

    def __init__(self, url: str) -> None:
        self.url = url

    @asynccontextmanager
    async def open(self, ctx: OriginContext, stale: Validators | None) -> AsyncIterator[Fetched]:
        async with ctx.upstream.open("GET", self.url) as response:
            if response.status != 200:
                raise UpstreamUnavailable(f"answered {response.status}")
            text = await response.read(64 * 2**20)
            body = text.replace(b"@@", BASE_URL_MARK.encode())

            async def one() -> AsyncIterator[bytes]:
                yield body

            yield Fetched(Status.OK, body=one(), content_type="application/json", length=len(body))


class Pages:
    def __init__(self, settings: RepositorySettings[PageOptions], ctx: ProxyContext) -> None:
        self.settings = settings
        self.cache = ctx.cache

    async def handle(self, request: Request) -> Response:
        spec = FetchSpec(
            key=request.path,
            kind=Kind.METADATA,
            origin=PageOrigin(UPSTREAM + request.path),
            ttl_s=self.settings.options.ttl_s,
            stream=False,
            base_url_marks=True,
        )
        # Digests of the stored bytes would not be those of what is sent: none are given.
        return await self.cache.respond(
            spec, request, digest_headers=lambda d: {"x-sha256": d["sha256"]}
        )


@pytest.fixture
def pages_format(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    module = types.ModuleType("tests.pages_format")
    module.FORMAT = FormatPlugin(name="pages", options=PageOptions, proxying=Proxying(build=Pages))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tests.pages_format", module)
    monkeypatch.setitem(formats.REGISTRY, "pages", "tests.pages_format")
    yield "pages"
    formats.plugin.cache_clear()


def pages_proxy(
    tmp_path: Path, upstream: dict[str, bytes], clock: ManualClock, server: str = ""
) -> InMemoryProxy:
    config = write_config(
        tmp_path,
        f"""
        [server]
        {server}
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "p"
        format = "pages"
        upstream = "{UPSTREAM}"
        """,
    )

    def handler(request: UpstreamRequest) -> MockResponse:
        if request.url in upstream:
            return MockResponse(200, upstream[request.url])
        raise UpstreamUnavailable("upstream down")

    return InMemoryProxy(load(config, {}), handler, clock)


def stored_body(proxy: InMemoryProxy, key: str) -> bytes:
    entry = proxy.catalog.entries[("p", key)]
    assert entry.sha256 is not None
    return proxy.engine.blobs.path(entry.sha256).read_bytes()


@pytest.mark.parametrize("size", [100, 2_000_000])  # in memory, and rewritten as it is read
async def test_each_client_gets_its_own_url_from_one_stored_body(
    pages_format: str, tmp_path: Path, size: int
) -> None:
    page = b'{"tarball": "@@x/-/x-1.0.tgz", "pad": "' + b"p" * size + b'", "again": "@@"}'
    async with pages_proxy(tmp_path, {UPSTREAM + "x": page}, ManualClock()) as proxy:
        first = await proxy.client.get("/p/x", headers={"Host": "one.example:8080"})
        second = await proxy.client.get("/p/x", headers={"Host": "two.example"})
        for answer, base in (
            (first, "http://one.example:8080/p/"),
            (second, "http://two.example/p/"),
        ):
            assert answer.status_code == 200
            assert answer.content == page.replace(b"@@", base.encode())
            assert answer.headers["content-length"] == str(len(answer.content))
            assert "accept-ranges" not in answer.headers
        assert first.headers["etag"] != second.headers["etag"]
        assert "x-sha256" not in first.headers and "x-sha256" not in second.headers
        assert len(proxy.upstream.requests) == 1
        neutral = stored_body(proxy, "x")
        assert neutral.count(BASE_URL_MARK.encode()) == 2 and b"example" not in neutral
        # Each representation revalidates on its own ETag, and HEAD has the length.
        etag = first.headers["etag"]
        again = await proxy.client.get(
            "/p/x", headers={"Host": "one.example:8080", "If-None-Match": etag}
        )
        assert again.status_code == 304
        other = await proxy.client.get(
            "/p/x", headers={"Host": "two.example", "If-None-Match": etag}
        )
        assert other.status_code == 200
        head = await proxy.client.head("/p/x", headers={"Host": "two.example"})
        assert head.headers["content-length"] == second.headers["content-length"]
        ranged = await proxy.client.get(
            "/p/x", headers={"Host": "two.example", "Range": "bytes=0-9"}
        )
        assert ranged.status_code == 200 and ranged.content == second.content


async def test_public_url_is_what_every_client_gets(pages_format: str, tmp_path: Path) -> None:
    page = b'{"u": "@@"}'
    server = 'public_url = "https://artifacts.example/base"'
    async with pages_proxy(tmp_path, {UPSTREAM + "x": page}, ManualClock(), server) as proxy:
        for host in ("one.example", "evil.example"):
            answer = await proxy.client.get("/p/x", headers={"Host": host})
            assert answer.content == b'{"u": "https://artifacts.example/base/p/"}'


async def test_a_stale_copy_is_filled_in_too_and_a_bad_host_is_refused(
    pages_format: str, tmp_path: Path
) -> None:
    clock = ManualClock()
    upstream = {UPSTREAM + "x": b'{"u": "@@"}'}
    async with pages_proxy(tmp_path, upstream, clock) as proxy:
        assert (await proxy.client.get("/p/x")).content == b'{"u": "http://proxy.test/p/"}'
        clock.advance(61)
        upstream.clear()  # the upstream is down now
        stale = await proxy.client.get("/p/x", headers={"Host": "other.example"})
        assert stale.content == b'{"u": "http://other.example/p/"}' and "warning" in stale.headers
        refused = await proxy.client.get("/p/x", headers={"Host": "a b"})
        assert refused.status_code == 400 and "server.public_url" in refused.text


def test_a_body_with_marks_cannot_stream() -> None:
    with pytest.raises(ValueError, match="cannot stream"):
        FetchSpec(key="k", kind=Kind.METADATA, origin=PageOrigin(UPSTREAM), base_url_marks=True)

"""The npm format (proxy/formats/npm.py), in memory: the whole app on proxy/testing's
MemoryCatalog and MockUpstream. tests/test_npm_clients.py runs the real npm client
against it over HTTP, on one process and on a fleet."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.contract import BASE_URL_MARK, View, Withheld
from proxy.exceptions import UpstreamUnavailable
from proxy.formats import npm, npm_packument
from proxy.formats.npm import dist_digests, negotiate, render_packument
from proxy.testing import InMemoryProxy, MockResponse, UpstreamRequest
from tests.conftest import write_config

pytestmark = pytest.mark.anyio

REGISTRY = "https://registry.example/"
FILES = "https://files.example/"
ABBREVIATED = "application/vnd.npm.install-v1+json"
NPM_ACCEPT = "application/vnd.npm.install-v1+json; q=1.0, application/json; q=0.8, */*"
TARBALLS = {
    ("left-pad", "1.0.0"): b"\x1f\x8b left-pad 1.0.0",
    ("left-pad", "1.1.0"): b"\x1f\x8b left-pad 1.1.0",
    ("@acme/util", "2.0.0"): b"\x1f\x8b util 2.0.0",
}


def sri(body: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(body).digest()).decode()


def packument(name: str, **override: Any) -> dict[str, Any]:
    versions = {}
    for (package, version), body in TARBALLS.items():
        if package == name:
            versions[version] = {
                "name": name,
                "version": version,
                "dependencies": {"left-pad": "^1.0.0"} if package != "left-pad" else {},
                "scripts": {"test": "true"},
                "dist": {
                    "tarball": f"{FILES}{name}/-/{name.rpartition('/')[2]}-{version}.tgz",
                    "integrity": sri(body),
                    "shasum": hashlib.sha1(body).hexdigest(),
                },
            }
    document = {
        "_id": name,
        "name": name,
        "dist-tags": {"latest": max(versions)},
        "versions": versions,
        "time": {v: f"2024-01-0{i + 1}T00:00:00.000Z" for i, v in enumerate(versions)}
        | {"modified": "2024-02-01T00:00:00.000Z"},
        "readme": "long text only the full document carries",
    }
    return document | override


class Upstream:
    """The handler: packuments under REGISTRY, tarballs under FILES."""

    def __init__(self) -> None:
        self.documents = {name: packument(name) for name in ("left-pad", "@acme/util")}
        self.bodies = {
            f"{FILES}{name}/-/{name.rpartition('/')[2]}-{version}.tgz": body
            for (name, version), body in TARBALLS.items()
        }
        self.down = False

    def __call__(self, request: UpstreamRequest) -> MockResponse:
        if self.down:
            raise UpstreamUnavailable("connection refused")
        if request.url in self.bodies:
            return MockResponse(200, self.bodies[request.url])
        name = request.url.removeprefix(REGISTRY).replace("%2f", "/").replace("%2F", "/")
        document = self.documents.get(name)
        if document is None:
            return MockResponse(404, b'{"error": "Not found"}')
        body = document if isinstance(document, bytes) else json.dumps(document).encode()
        return MockResponse(200, body, {"content-type": "application/json"})


@asynccontextmanager
async def npm_proxy(
    tmp_path: Path, upstream: Upstream, clock: ManualClock | None = None, server: str = ""
) -> AsyncIterator[InMemoryProxy]:
    config = write_config(
        tmp_path,
        f"""
        [server]
        {server}
        [storage]
        path = "{tmp_path / "data"}"
        [[repositories]]
        name = "npm"
        format = "npm"
        upstream = "{REGISTRY}"
        metadata_ttl = "5m"
        """,
    )
    async with InMemoryProxy(load(config, {}), upstream, clock or ManualClock()) as proxy:
        yield proxy


def stored(proxy: InMemoryProxy, key: str) -> bytes:
    entry = proxy.catalog.entries[("npm", key)]
    assert entry.sha256 is not None
    return proxy.engine.blobs.path(entry.sha256).read_bytes()


async def test_abbreviated_and_full_packuments(tmp_path: Path) -> None:
    upstream = Upstream()
    async with npm_proxy(tmp_path, upstream) as p:
        short = await p.client.get("/npm/left-pad", headers={"Accept": NPM_ACCEPT})
        assert short.status_code == 200
        assert short.headers["content-type"] == ABBREVIATED
        # Its tarball URLs name the Host this client sent (no server.public_url here).
        assert short.headers["vary"] == "Accept, Host, X-Forwarded-Proto"
        doc = short.json()
        assert set(doc) == {"name", "modified", "dist-tags", "versions"}
        assert doc["dist-tags"] == {"latest": "1.1.0"}
        version = doc["versions"]["1.0.0"]
        assert "scripts" not in version and version["dependencies"] == {}
        assert version["dist"] == {
            "tarball": "http://proxy.test/npm/left-pad/-/left-pad-1.0.0.tgz",
            "integrity": sri(TARBALLS[("left-pad", "1.0.0")]),
            "shasum": hashlib.sha1(TARBALLS[("left-pad", "1.0.0")]).hexdigest(),
        }
        full = await p.client.get("/npm/left-pad")
        assert full.headers["content-type"] == "application/json"
        document = full.json()
        # Everything the upstream said is kept, publish times too (a cooldown reads them).
        assert document["time"] == upstream.documents["left-pad"]["time"]
        assert document["readme"] and document["versions"]["1.0.0"]["scripts"] == {"test": "true"}
        assert document["versions"]["1.1.0"]["dist"]["tarball"].startswith("http://proxy.test/npm/")
        # One upstream document for both representations, asked for in full.
        assert [(r.url, r.headers["accept"]) for r in p.upstream.requests] == [
            (REGISTRY + "left-pad", "application/json")
        ]
        again = await p.client.get("/npm/left-pad", headers={"Accept": NPM_ACCEPT})
        assert again.content == short.content and len(p.upstream.requests) == 1
        head = await p.client.head("/npm/left-pad", headers={"Accept": NPM_ACCEPT})
        assert head.headers["content-length"] == str(len(short.content)) and head.content == b""


@pytest.mark.parametrize(
    ("accept", "representation"),
    [
        (NPM_ACCEPT, "abbreviated"),
        (ABBREVIATED, "abbreviated"),
        (None, "full"),
        ("*/*", "full"),
        ("application/json", "full"),
        ("application/json, application/vnd.npm.install-v1+json;q=0.5", "full"),
        ("application/vnd.npm.install-v1+json;q=0, application/json", "full"),
        ("text/html", None),
        ("application/json;q=0", None),
        # The most specific range decides each type's weight (RFC 9110, 12.5.1): a type
        # refused by name stays refused, whatever */* says, and a range covers both.
        ("application/json;q=0, */*", "abbreviated"),
        ("application/json;q=0.5, application/*;q=0.9", "abbreviated"),
        ("application/vnd.npm.install-v1+json;q=0, */*", "full"),
        ("application/*", "full"),
        ("application/json;q=0, application/vnd.npm.install-v1+json;q=0, */*", None),
    ],
)
def test_negotiation(accept: str | None, representation: str | None) -> None:
    assert negotiate(accept) == representation


async def test_scoped_packages_in_both_spellings(tmp_path: Path) -> None:
    async with npm_proxy(tmp_path, Upstream()) as p:
        bodies = set()
        # The @ escaped too (encodeURIComponent of the whole name) means the same.
        spellings = ("@acme%2futil", "@acme%2Futil", "@acme/util", "%40acme%2Futil", "%40acme/util")
        for path in (f"/npm/{spelling}" for spelling in spellings):
            answer = await p.client.get(path, headers={"Accept": NPM_ACCEPT})
            assert answer.status_code == 200, answer.text
            bodies.add(answer.content)
        [body] = bodies
        tarball_url = json.loads(body)["versions"]["2.0.0"]["dist"]["tarball"]
        assert tarball_url == "http://proxy.test/npm/@acme/util/-/util-2.0.0.tgz"
        assert [r.url for r in p.upstream.requests] == [REGISTRY + "@acme%2Futil"]
        for path in ("/npm/@acme/util/-/util-2.0.0.tgz", "/npm/@acme%2futil/-/util-2.0.0.tgz"):
            assert (await p.client.get(path)).content == TARBALLS[("@acme/util", "2.0.0")]
        assert p.upstream.count(f"{FILES}@acme/util/-/util-2.0.0.tgz") == 1


async def test_tarball_urls_follow_each_client_and_what_is_stored_names_no_host(
    tmp_path: Path,
) -> None:
    async with npm_proxy(tmp_path, Upstream()) as p:
        seen = {}
        for host in ("ci.internal:8080", "laptop.example"):
            answer = await p.client.get(
                "/npm/left-pad", headers={"Accept": NPM_ACCEPT, "Host": host}
            )
            seen[host] = answer.json()["versions"]["1.0.0"]["dist"]["tarball"]
        assert seen == {
            "ci.internal:8080": "http://ci.internal:8080/npm/left-pad/-/left-pad-1.0.0.tgz",
            "laptop.example": "http://laptop.example/npm/left-pad/-/left-pad-1.0.0.tgz",
        }
        neutral = stored(p, "packument/left-pad")
        assert neutral.count(BASE_URL_MARK.encode()) == 2
        assert (
            b"ci.internal" not in neutral
            and b"laptop" not in neutral
            and b"files.example" not in neutral
        )
        assert len(p.upstream.requests) == 1
        # A Host header that is no host cannot reach the body.
        refused = await p.client.get("/npm/left-pad", headers={"Accept": NPM_ACCEPT, "Host": 'x"y'})
        assert refused.status_code == 400 and "public_url" in refused.text


async def test_public_url_names_the_proxy_for_every_client(tmp_path: Path) -> None:
    server = 'public_url = "https://artifacts.example/base"'
    async with npm_proxy(tmp_path, Upstream(), server=server) as p:
        for host in ("ci.internal", "evil.example"):
            answer = await p.client.get(
                "/npm/left-pad", headers={"Accept": NPM_ACCEPT, "Host": host}
            )
            tarball = answer.json()["versions"]["1.0.0"]["dist"]["tarball"]
            assert tarball == "https://artifacts.example/base/npm/left-pad/-/left-pad-1.0.0.tgz"


async def test_tarballs_are_verified_against_integrity_and_shasum(tmp_path: Path) -> None:
    upstream = Upstream()
    versions = upstream.documents["left-pad"]["versions"]
    versions["1.0.0"]["dist"]["integrity"] = sri(b"other bytes")
    del versions["1.1.0"]["dist"]["integrity"]  # an old package: a shasum only
    versions["1.1.0"]["dist"]["shasum"] = "0" * 40
    async with npm_proxy(tmp_path, upstream) as p:
        for version, digest in (("1.0.0", "sha512"), ("1.1.0", "sha1")):
            refused = await p.client.get(f"/npm/left-pad/-/left-pad-{version}.tgz")
            assert refused.status_code == 502 and digest in refused.text, refused.text
            assert ("npm", f"left-pad/-/left-pad-{version}.tgz") not in p.catalog.entries
        good = await p.client.get("/npm/@acme/util/-/util-2.0.0.tgz")
        assert good.status_code == 200 and good.content == TARBALLS[("@acme/util", "2.0.0")]
        assert good.headers["cache-control"] == "public, max-age=31536000, immutable"


def test_dist_digests_reads_sri_and_shasum() -> None:
    """As npm checks a tarball: against the strongest algorithm of ``integrity``, else
    ``shasum``. Checking every digest listed refused tarballs npm itself installs from
    the same packument (a stale ``shasum`` or a weaker SRI entry beside a right sha512)."""
    body = b"tarball"
    sha512 = {"sha512": hashlib.sha512(body).hexdigest()}
    assert dist_digests({"integrity": sri(body), "shasum": hashlib.sha1(body).hexdigest()}) == (
        sha512
    )
    assert dist_digests({"integrity": f"sha1-xxx {sri(body)}", "shasum": "0" * 40}) == sha512
    weak = "sha1-" + base64.b64encode(hashlib.sha1(body).digest()).decode()
    assert dist_digests({"integrity": f"{weak} sha512-not*base64"}) == {
        "sha1": hashlib.sha1(body).hexdigest()
    }
    assert dist_digests({"integrity": "sha512-not*base64", "shasum": "A" * 40}) == {
        "sha1": "a" * 40
    }
    assert dist_digests({"integrity": "sha512-not*base64", "shasum": "nothex"}) == {}
    assert dist_digests({"integrity": "md5-" + base64.b64encode(b"x" * 16).decode()}) == {}
    assert dist_digests({"integrity": "sha512-" + base64.b64encode(b"short").decode()}) == {}


async def test_a_tarball_npm_accepts_is_not_refused_for_a_stale_shasum(tmp_path: Path) -> None:
    upstream = Upstream()
    dist = upstream.documents["left-pad"]["versions"]["1.0.0"]["dist"]
    dist["shasum"] = "0" * 40  # wrong, beside a right sha512: npm checks the sha512 only
    async with npm_proxy(tmp_path, upstream) as p:
        answer = await p.client.get("/npm/left-pad/-/left-pad-1.0.0.tgz")
        assert answer.status_code == 200, answer.text
        assert answer.content == TARBALLS[("left-pad", "1.0.0")]


async def test_only_tarballs_a_packument_listed_are_fetched(tmp_path: Path) -> None:
    upstream = Upstream()
    upstream.bodies[f"{FILES}left-pad/-/left-pad-6.6.6.tgz"] = b"never listed"
    async with npm_proxy(tmp_path, upstream) as p:
        # Unknown yet: the packument is fetched first (a lock file's npm ci does this).
        assert (await p.client.get("/npm/left-pad/-/left-pad-1.0.0.tgz")).status_code == 200
        assert p.upstream.requests[0].url == REGISTRY + "left-pad"
        missing = await p.client.get("/npm/left-pad/-/left-pad-6.6.6.tgz")
        assert missing.status_code == 404 and "not listed in the packument" in missing.text
        assert p.upstream.count(f"{FILES}left-pad/-/left-pad-6.6.6.tgz") == 0
        assert (await p.client.get("/npm/left-pad/-/..%2f..%2fetc.tgz")).status_code == 400


async def test_dist_tags_and_version_documents(tmp_path: Path) -> None:
    async with npm_proxy(tmp_path, Upstream()) as p:
        tags = await p.client.get("/npm/-/package/left-pad/dist-tags")
        assert tags.json() == {"latest": "1.1.0"}
        scoped = await p.client.get("/npm/-/package/@acme%2futil/dist-tags")
        assert scoped.json() == {"latest": "2.0.0"}
        latest = await p.client.get("/npm/left-pad/latest", headers={"Host": "h.example"})
        assert latest.json()["version"] == "1.1.0"
        assert (
            latest.json()["dist"]["tarball"] == "http://h.example/npm/left-pad/-/left-pad-1.1.0.tgz"
        )
        assert (await p.client.get("/npm/left-pad/1.0.0")).json()["version"] == "1.0.0"
        assert (await p.client.get("/npm/left-pad/9.9.9")).status_code == 404
        assert (await p.client.get("/npm/@acme/util/2.0.0")).json()["name"] == "@acme/util"


# What is not offered is a 4xx, never a 5xx: npm retries 5xx answers (twice, 10 s and
# then 60 s apart), so a 501 made `npm publish` fail after 2.5 minutes, `npm search`
# after 70 s. Writes to a package are 405 (read-only), endpoints the proxy lacks 404.
@pytest.mark.parametrize(
    ("method", "path", "status", "says"),
    [
        ("PUT", "/npm/left-pad", 405, "publishing"),
        ("DELETE", "/npm/left-pad/-rev/1", 405, "unpublishing"),
        ("POST", "/npm/-/npm/v1/security/advisories/bulk", 404, "audit"),
        ("POST", "/npm/-/npm/v1/security/audits/quick", 404, "audit"),
        ("GET", "/npm/-/v1/search?text=pad", 404, "search"),
        ("PUT", "/npm/-/user/org.couchdb.user:bob", 404, "login"),
        ("POST", "/npm/-/v1/login", 404, "login"),
        ("GET", "/npm/-/whoami", 404, "login"),
        ("PUT", "/npm/-/package/left-pad/dist-tags/next", 405, "dist-tags"),
        ("DELETE", "/npm/-/package/@acme%2futil/dist-tags/next", 405, "dist-tags"),
        ("POST", "/npm/left-pad", 405, "not allowed"),
        ("GET", "/npm/-/nothing", 404, "no such npm registry endpoint"),
        ("GET", "/npm/", 404, "name a package"),
        ("GET", "/npm/a%2Fb", 400, "not allowed"),
        ("GET", "/npm/@acme", 400, "not an npm package name"),
        ("GET", "/npm/%40acme", 400, "not an npm package name"),
        ("GET", "/npm/@/x", 400, "not an npm package name"),
        ("GET", "/npm/%40%2Fx", 400, "not an npm package name"),
        ("GET", "/npm/@acme%2F..", 400, "not allowed"),
        ("GET", "/npm/@acme%2Futil%2Fx", 400, "not allowed"),
        ("GET", "/npm/@acme%2F%00", 400, "not allowed"),
        ("GET", "/npm/left%0Apad", 400, "not allowed"),  # JSON, as every other error
        ("GET", "/npm/Bad%20Name", 400, "not an npm package name"),
        ("GET", "/npm/left-pad/a/b", 404, "no such npm registry path"),
    ],
)
async def test_what_is_not_offered_says_so(
    tmp_path: Path, method: str, path: str, status: int, says: str
) -> None:
    async with npm_proxy(tmp_path, Upstream()) as p:
        answer = await p.client.request(method, path)
        assert answer.status_code == status and says in answer.text, answer.text
        if status == 405:
            assert answer.headers["allow"] == "GET, HEAD"
        assert p.upstream.requests == []
        ping = await p.client.get("/npm/-/ping")
        assert (ping.status_code, ping.json()) == (200, {})


async def test_hostile_packuments(tmp_path: Path) -> None:
    upstream = Upstream()
    evil = packument("left-pad")
    evil["versions"]["../../x"] = {"dist": {"tarball": FILES + "x.tgz"}}
    evil["versions"]["2.0.0"] = {"dist": {"tarball": "file:///etc/passwd"}}
    evil["versions"]["3.0.0"] = "not an object"
    evil["dist-tags"]["next"] = "2.0.0"
    upstream.documents["left-pad"] = evil
    upstream.documents["garbage"] = b"<html>not json</html>"  # type: ignore[assignment]
    upstream.documents["other"] = packument("left-pad")  # names another package
    async with npm_proxy(tmp_path, upstream) as p:
        answer = await p.client.get("/npm/left-pad")
        assert sorted(answer.json()["versions"]) == ["1.0.0", "1.1.0"]
        assert answer.json()["dist-tags"] == {"latest": "1.1.0"}
        for name, says in (("garbage", "is not a packument"), ("other", "not 'other'")):
            refused = await p.client.get(f"/npm/{name}")
            assert refused.status_code == 502 and says in refused.text, refused.text


async def test_a_stale_packument_answers_while_the_upstream_is_down(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream()
    async with npm_proxy(tmp_path, upstream, clock) as p:
        fresh = await p.client.get("/npm/left-pad", headers={"Accept": NPM_ACCEPT})
        assert (await p.client.get("/npm/left-pad/-/left-pad-1.1.0.tgz")).status_code == 200
        clock.advance(301)
        upstream.down = True
        stale = await p.client.get("/npm/left-pad", headers={"Accept": NPM_ACCEPT})
        assert stale.status_code == 200 and stale.content == fresh.content
        assert stale.headers["warning"] == '110 - "Response is Stale"'
        tarball = await p.client.get("/npm/left-pad/-/left-pad-1.1.0.tgz")
        assert tarball.content == TARBALLS[("left-pad", "1.1.0")]
        assert (await p.client.get("/npm/absent")).status_code == 502  # never a 404


async def test_mirrors_warm_the_tarballs_a_purl_names(tmp_path: Path) -> None:
    async with npm_proxy(tmp_path, Upstream()) as p:
        mirrors = p.engine.mirrors
        latest = await mirrors.run(
            "m", ["pkg:npm/left-pad", "pkg:npm/%40acme/util@2.0.0"], None, "latest", None
        )
        assert (latest.fetched, latest.failed, latest.missing) == (2, 0, 0)
        assert p.upstream.count(f"{FILES}left-pad/-/left-pad-1.1.0.tgz") == 1
        assert p.upstream.count(f"{FILES}left-pad/-/left-pad-1.0.0.tgz") == 0
        every = await mirrors.run("m", ["pkg:npm/left-pad"], None, "all", None)
        assert (every.fetched, every.cached) == (1, 1)
        absent = await mirrors.run(
            "m", ["pkg:npm/left-pad@7.0.0", "pkg:npm/nothing"], None, "latest", None
        )
        assert absent.missing == 2


async def test_a_large_packument_is_parsed_off_the_loop_and_filled_in_as_it_is_read(
    tmp_path: Path,
) -> None:
    """Thousands of versions: parsed and rendered in a child process (over 8 KiB), stored
    once, its tarball URLs filled in chunk by chunk (over 256 KiB) for each client."""
    upstream = Upstream()
    big = packument("left-pad")
    template = big["versions"]["1.0.0"]
    for i in range(3000):
        version = f"0.{i}.0"
        big["versions"][version] = template | {
            "version": version,
            "description": "x" * 100,
            "dist": template["dist"] | {"tarball": f"{FILES}left-pad/-/left-pad-{version}.tgz"},
        }
    upstream.documents["left-pad"] = big
    async with npm_proxy(tmp_path, upstream) as p:
        answer = await p.client.get("/npm/left-pad", headers={"Host": "ci.internal"})
        assert answer.status_code == 200
        assert int(answer.headers["content-length"]) == len(answer.content) > 300_000
        document = answer.json()
        assert len(document["versions"]) == 3002
        assert {
            v["dist"]["tarball"].rsplit("/-/", 1)[0] for v in document["versions"].values()
        } == {"http://ci.internal/npm/left-pad"}
        assert (await p.client.get("/npm/-/package/left-pad/dist-tags")).json() == {
            "latest": "1.1.0"
        }
        link = p.catalog.links[("npm", "left-pad/-/left-pad-0.2999.0.tgz")]
        assert link.url == f"{FILES}left-pad/-/left-pad-0.2999.0.tgz" and "sha512" in link.digests


async def test_an_sbom_of_npm_purls_drives_a_mirror(tmp_path: Path) -> None:
    sbom = tmp_path / "sbom.cdx.json"
    sbom.write_text(
        json.dumps(
            {
                "bomFormat": "CycloneDX",
                "specVersion": "1.6",
                "components": [
                    {"type": "library", "name": "util", "purl": "pkg:npm/%40acme/util@2.0.0"},
                    {"type": "library", "name": "left-pad", "purl": "pkg:npm/left-pad@1.0.0"},
                ],
            }
        )
    )
    async with npm_proxy(tmp_path, Upstream()) as p:
        summary = await p.engine.mirrors.run("sbom", [], sbom, "latest", None)
        assert (summary.fetched, summary.failed) == (2, 0)
        assert ("npm", "@acme/util/-/util-2.0.0.tgz") in p.catalog.entries
        assert ("npm", "left-pad/-/left-pad-1.0.0.tgz") in p.catalog.entries


@pytest.mark.parametrize(
    "document",
    [
        b"[1, 2]",
        b'{"name": 5}',
        b'{"versions": []}',
        b'{"versions": {"1.0.0": {"dist": {"tarball": 5, "integrity": 5, "shasum": []}}}}',
        b'{"versions": {"1.0.0": {"dist": []}}, "dist-tags": {"latest": ["1.0.0"], "x": {}}}',
        b'{"versions": {}, "dist-tags": "latest", "time": "never", "modified": 7}',
        b'{"versions": {"1.0.0": {"dist": {"tarball": "https://f.example/a.tgz"}, "n": NaN}}}',
        b'{"versions": {"1.0.0": {"dist": {"tarball": "https://f.example/a.tgz"}, "n": 1e999}}}',
        b'{"readme": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"description": "\\ud800 a lone surrogate", "versions": {}}',
        b"\xff\xfe not utf-8",
    ],
)
def test_a_hostile_packument_is_refused_or_cleaned_never_a_crash(document: bytes) -> None:
    """What an upstream sends cannot break the renderer: it is either a packument
    (what we cannot serve left out) or a ValueError, which the origin turns into a 502."""
    try:
        model, _links = render_packument(document, REGISTRY + "x", "npm", "x")
    except ValueError:
        return
    listed = npm_packument.listing(model)
    withheld = {v.version: Withheld("deny", "x") for v in listed.versions}
    seen = {npm_packument.tarball_key("x", v.version): 0 for v in listed.versions}
    for representation in ("full", "abbreviated"):
        for view in (View(), View(withheld), View(published=seen)):
            rendered = npm_packument.render(model, view, representation)
        parsed = json.loads(rendered.replace(BASE_URL_MARK.encode(), b""))
        assert parsed["name"] == "x" and isinstance(parsed["versions"], dict)
        assert all(isinstance(v, str) for v in parsed["dist-tags"].values())


async def test_errors_are_json_with_the_message_npm_shows(tmp_path: Path) -> None:
    """npm shows an error answer's message only from a JSON body's ``error`` (after the
    status and URL); a plain-text body it drops. The npm format declares so, and every
    error of its repositories is ``{"error": message}``; other formats keep text."""
    upstream = Upstream()
    upstream.documents["left-pad"]["versions"]["1.0.0"]["dist"]["integrity"] = sri(b"other")
    async with npm_proxy(tmp_path, upstream) as p:
        for method, path, status, says in (
            ("PUT", "/npm/left-pad", 405, "publishing"),
            ("GET", "/npm/-/v1/search?text=x", 404, "search is not offered"),
            ("GET", "/npm/absent", 404, "'absent' not found on the upstream registry"),
            ("GET", "/npm/left-pad/-/left-pad-1.0.0.tgz", 502, "nothing was stored"),
            ("GET", "/npm/@acme", 400, "not an npm package name"),
        ):
            answer = await p.client.request(method, path)
            assert answer.status_code == status
            assert answer.headers["content-type"] == "application/json"
            assert says in answer.json()["error"], answer.text
        unknown = await p.client.get("/nowhere/x")  # no repository: no format to ask
        assert unknown.status_code == 404 and unknown.headers["content-type"].startswith(
            "text/plain"
        )


async def test_look_ups_in_a_big_packument_hold_few_copies_at_once(tmp_path: Path) -> None:
    """``/<name>/<version>`` and dist-tags read the whole stored packument and ask a
    parser about it. Forty clients at once each held their own copy while they waited
    for the two parsers (a 34 MB packument took a replica from 110 MB to 1.5 GB): now
    only as many copies are read as can be parsed at once, whatever the load."""
    upstream = Upstream()
    big = packument("left-pad")
    template = big["versions"]["1.0.0"]
    for i in range(300):
        big["versions"][f"0.{i}.0"] = template | {"version": f"0.{i}.0", "readme": "x" * 200}
    upstream.documents["left-pad"] = big
    async with npm_proxy(tmp_path, upstream) as p:
        assert (await p.client.get("/npm/left-pad")).status_code == 200
        adapter: Any = p.engine.adapters["npm"]
        held, most = 0, 0
        read, compute = adapter.cache.read, adapter.compute

        async def counted_read(*args: Any) -> bytes:
            nonlocal held, most
            body: bytes = await read(*args)
            held += 1
            most = max(most, held)
            return body

        async def counted_compute(*args: Any) -> Any:
            nonlocal held
            try:
                return await compute(*args)
            finally:
                held -= 1

        adapter.cache = types.SimpleNamespace(read=counted_read, respond=adapter.cache.respond)
        adapter.compute = counted_compute
        answers = await asyncio.gather(
            *(p.client.get(f"/npm/left-pad/0.{i}.0") for i in range(40)),
            *(p.client.get("/npm/-/package/left-pad/dist-tags") for _ in range(10)),
        )
        assert [a.status_code for a in answers] == [200] * 50
        assert [a.json()["version"] for a in answers[:40]] == [f"0.{i}.0" for i in range(40)]
        assert most <= npm.LOOK_UPS_AT_ONCE, most

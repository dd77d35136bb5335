"""The release policy applied by the engine (proxy/policy/gate.py), through the whole app
in memory (proxy/testing): PyPI pages and files under a cooldown, deny rules, report
mode, unknown publish times, quarantine, and every path of a held file (GET, HEAD,
Range, 304, metadata and provenance files, cached or not). Time is the engine's
ManualClock: publish times are set relative to it, nothing sleeps."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.formats.simple_model import format_upload_time
from proxy.runtime import metrics
from proxy.testing import InMemoryProxy, MockResponse, UpstreamRequest
from tests.conftest import write_config

pytestmark = pytest.mark.anyio

JSON_V1 = "application/vnd.pypi.simple.v1+json"
INDEX = "https://upstream.example/simple/"
FILES = "https://files.example/"
DAY_S = 86400


def wheel(version: str) -> tuple[str, bytes]:
    return f"demo-{version}-py3-none-any.whl", f"PK wheel {version}".encode()


class Upstream:
    """A PyPI upstream whose files were published ``ages`` days before it was made
    (None: the page states no upload-time)."""

    def __init__(self, clock: ManualClock, ages: dict[str, float | None]) -> None:
        self.clock = clock
        self.made_ms = clock.now_ms()
        self.ages = ages
        self.provenance = b'{"attestation_bundles": []}'

    def page(self) -> bytes:
        files = []
        for version, age in self.ages.items():
            filename, body = wheel(version)
            item: dict[str, object] = {
                "filename": filename,
                "url": FILES + filename,
                "hashes": {"sha256": hashlib.sha256(body).hexdigest()},
                "size": len(body),
                "core-metadata": {"sha256": hashlib.sha256(b"META " + body).hexdigest()},
                "provenance": FILES + filename + ".provenance",
            }
            if age is not None:
                at_ms = self.made_ms - int(age * DAY_S * 1000)
                item["upload-time"] = format_upload_time(at_ms)
            files.append(item)
        return json.dumps(
            {
                "meta": {"api-version": "1.4"},
                "name": "demo",
                "files": files,
                "versions": list(self.ages),
            }
        ).encode()

    def __call__(self, request: UpstreamRequest) -> MockResponse:
        if request.url == INDEX + "demo/":
            return MockResponse(200, self.page(), {"content-type": JSON_V1})
        for version in self.ages:
            filename, body = wheel(version)
            if request.url == FILES + filename:
                return MockResponse(200, body)
            if request.url == FILES + filename + ".metadata":
                return MockResponse(200, b"META " + body)
            if request.url == FILES + filename + ".provenance":
                return MockResponse(200, self.provenance)
        return MockResponse(404, b"not found")


@asynccontextmanager
async def running(
    tmp_path: Path,
    handler: Callable[[UpstreamRequest], MockResponse],
    clock: ManualClock,
    policy: str = "",
    repository: str = "",
) -> AsyncIterator[InMemoryProxy]:
    tmp_path.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - a test's own folder
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        {policy}
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "{INDEX}"
        {repository}
        """,
    )
    async with InMemoryProxy(load(config, {}), handler, clock) as proxy:
        yield proxy


COOLDOWN = '[policy]\ncooldown = "3d"\n'


async def versions_offered(proxy: InMemoryProxy) -> tuple[list[str], list[str]]:
    """(versions of the JSON page, versions whose file the HTML page links)."""
    data = (await proxy.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})).json()
    html = (await proxy.client.get("/pypi/simple/demo/", headers={"Accept": "text/html"})).text
    linked = [v for v in ("1.0", "2.0", "3.0") if f"demo-{v}-py3-none-any.whl<" in html]
    files = sorted({f["filename"].split("-")[1] for f in data["files"]})
    assert files == linked, "the HTML and the JSON page must offer the same files"
    return data["versions"], linked


async def test_a_cooldown_hides_new_versions_from_both_pages_until_it_ends(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 5, "3.0": 1})
    async with running(tmp_path, upstream, clock, COOLDOWN) as proxy:
        assert await versions_offered(proxy) == (["1.0", "2.0"], ["1.0", "2.0"])
        response = await proxy.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})
        # A shared cache may keep the page only until 3.0's hold ends (in two days).
        assert response.headers["cache-control"] == "public, max-age=600"
        clock.advance(2 * DAY_S + 1)
        assert await versions_offered(proxy) == (["1.0", "2.0", "3.0"], ["1.0", "2.0", "3.0"])


async def test_max_age_never_outlasts_a_hold(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 3 - 100 / DAY_S})  # free in 100 s
    async with running(tmp_path, upstream, clock, COOLDOWN) as proxy:
        response = await proxy.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})
        assert response.headers["cache-control"] == "public, max-age=100"
        assert [f["filename"] for f in response.json()["files"]] == [wheel("1.0")[0]]


async def test_a_held_file_is_refused_on_every_path_cached_or_not(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 1})
    held, _ = wheel("2.0")
    async with running(tmp_path, upstream, clock) as proxy:
        # No policy yet: 2.0 is cached, its metadata and provenance too.
        for suffix in ("", ".metadata", ".provenance"):
            got = await proxy.client.get(f"/pypi/files/demo/{held}{suffix}")
            assert got.status_code == 200
        etag = (await proxy.client.get(f"/pypi/files/demo/{held}")).headers["etag"]
        fetched = len(upstream_requests(proxy))
        proxy.engine.reload_policy(load(policy_file(tmp_path, COOLDOWN), {}))
        requests = [
            ("GET", "", {}),
            ("HEAD", "", {}),
            ("GET", "", {"range": "bytes=0-3"}),
            ("GET", "", {"if-none-match": etag}),
            ("GET", ".metadata", {}),
            ("HEAD", ".metadata", {}),
            ("GET", ".provenance", {}),
        ]
        for method, suffix, headers in requests:
            refused = await proxy.client.request(
                method, f"/pypi/files/demo/{held}{suffix}", headers=headers
            )
            assert refused.status_code == 403, (method, suffix, headers)
            if method == "GET":
                assert "pkg:pypi/demo@2.0 is held back until" in refused.text
                assert "policy.cooldown" in refused.text
        # Refused from what is stored: nothing was fetched again.
        assert len(upstream_requests(proxy)) == fetched
        assert (await proxy.client.get(f"/pypi/files/demo/{wheel('1.0')[0]}")).status_code == 200


def upstream_requests(proxy: InMemoryProxy) -> list[str]:
    return [r.url for r in proxy.upstream.requests]


def policy_file(tmp_path: Path, policy: str, name: str = "reloaded.toml") -> Path:
    """A config like ``running``'s, with another [policy]."""
    return write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        {policy}
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "{INDEX}"
        """,
        name,
    )


async def test_a_refusal_says_what_why_which_rule_and_when(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 1})
    held, _ = wheel("2.0")
    async with running(tmp_path, upstream, clock, COOLDOWN) as proxy:
        text = await proxy.client.get(f"/pypi/files/demo/{held}")
        assert text.status_code == 403
        assert text.headers["content-type"].startswith("text/plain")
        published = format_upload_time(clock.now_ms() - DAY_S * 1000)[:19]
        assert f"files/demo/{held}: pkg:pypi/demo@2.0 is held back until " in text.text
        assert f"published {published}" in text.text and "(upload-time)" in text.text
        problem = await proxy.client.get(
            f"/pypi/files/demo/{held}", headers={"Accept": "application/problem+json"}
        )
        assert problem.status_code == 403
        assert problem.headers["content-type"] == "application/problem+json"
        document = problem.json()
        assert document["type"] == "urn:artifact-proxy:release-policy:held"
        assert document["status"] == 403 and document["title"]
        assert document["detail"] == text.text.strip()
        assert document["instance"] == f"/pypi/files/demo/{held}"
        assert document["package"] == "pkg:pypi/demo" and document["version"] == "2.0"
        assert (document["action"], document["rule"]) == ("hold", "cooldown")
        assert document["setting"] == "policy.cooldown"
        assert document["published_from"] == "upload-time"
        assert document["available_at"] > document["published_at"]


async def test_a_repository_cooldown_wins_and_a_rule_exempts_a_package(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 5, "3.0": 1})
    policy = COOLDOWN + '[[policy.rules]]\nmatch = "pkg:pypi/other"\ncooldown = "0"\n'
    async with running(tmp_path, upstream, clock, policy, 'cooldown = "7d"') as proxy:
        assert (await versions_offered(proxy))[1] == ["1.0"]
        refused = await proxy.client.get(f"/pypi/files/demo/{wheel('2.0')[0]}")
        assert "repositories.pypi.cooldown" in refused.text
    exempt = COOLDOWN + '[[policy.rules]]\nmatch = "pkg:pypi/Demo"\ncooldown = "0"\n'
    async with running(tmp_path / "2", upstream, clock, exempt, 'cooldown = "7d"') as proxy:
        assert (await versions_offered(proxy))[1] == ["1.0", "2.0", "3.0"]


async def test_a_deny_rule_with_a_version_range(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 20, "3.0": 10})
    policy = """
    [[policy.rules]]
    match = "pkg:pypi/demo"
    versions = "vers:pypi/>=2.0|<3"
    action = "deny"
    reason = "compromised release, see INC-123"
    name = "inc-123"
    """
    async with running(tmp_path, upstream, clock, policy) as proxy:
        assert await versions_offered(proxy) == (["1.0", "3.0"], ["1.0", "3.0"])
        before = metric("pypi", "deny", "inc-123")
        refused = await proxy.client.get(
            f"/pypi/files/demo/{wheel('2.0')[0]}", headers={"Accept": "application/problem+json"}
        )
        document = refused.json()
        assert document["type"] == "urn:artifact-proxy:release-policy:denied"
        assert document["reason"] == "compromised release, see INC-123"
        assert (document["rule"], document["setting"]) == ("inc-123", "policy.rules[0]")
        assert metric("pypi", "deny", "inc-123") == before + 1


def metric(repository: str, action: str, rule: str) -> float:
    value = metrics.POLICY_DECISIONS.labels(repository, action, rule)._value.get()
    assert isinstance(value, float)
    return value


async def test_every_version_denied_is_a_quarantined_project(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 20})
    policy = '[[policy.rules]]\nmatch = "pkg:pypi/demo"\naction = "deny"\nreason = "malware"\n'
    async with running(tmp_path, upstream, clock, policy) as proxy:
        data = (await proxy.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})).json()
        assert data["project-status"] == {"status": "quarantined", "reason": "malware"}
        assert data["files"] == [] and data["versions"] == []
        html = (await proxy.client.get("/pypi/simple/demo/")).text
        assert '<meta name="pypi:project-status" content="quarantined">' in html
        assert '<meta name="pypi:project-status-reason" content="malware">' in html
        assert "demo-1.0" not in html


async def test_report_mode_decides_and_counts_but_serves_everything(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 1})
    policy = '[policy]\ncooldown = "3d"\nmode = "report"\n'
    async with running(tmp_path, upstream, clock, policy) as proxy:
        before = metric("pypi", "hold", "cooldown")
        assert await versions_offered(proxy) == (["1.0", "2.0"], ["1.0", "2.0"])
        # Each page request counts the version it would withhold.
        assert metric("pypi", "hold", "cooldown") == before + 2
        got = await proxy.client.get(f"/pypi/files/demo/{wheel('2.0')[0]}")
        assert got.status_code == 200
        assert metric("pypi", "hold", "cooldown") == before + 3


async def test_exclude_newer_denies_what_was_published_after_it(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30, "2.0": 10})
    from proxy.units import format_timestamp

    cutoff = format_timestamp(clock.now_ms() - 20 * DAY_S * 1000)
    async with running(tmp_path, upstream, clock, f'[policy]\nexclude_newer = "{cutoff}"') as p:
        assert (await versions_offered(p))[1] == ["1.0"]
        refused = await p.client.get(f"/pypi/files/demo/{wheel('2.0')[0]}")
        assert refused.status_code == 403 and "policy.exclude_newer" in refused.text


async def test_an_upstream_without_upload_times_is_judged_by_first_sight(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": None})
    async with running(tmp_path, upstream, clock, COOLDOWN) as proxy:
        seen_ms = clock.now_ms()
        # First seen now: held for the whole cooldown.
        assert (await versions_offered(proxy))[1] == []
        clock.advance(3 * DAY_S + 1)
        upstream.ages["2.0"] = None  # a new release, first seen three days after 1.0
        assert (await versions_offered(proxy))[1] == ["1.0"]
        data = (await proxy.client.get("/pypi/simple/demo/", headers={"Accept": JSON_V1})).json()
        # Served with the time this fleet first saw it, so clients can filter by age too.
        [offered] = data["files"]
        assert offered["upload-time"] == format_upload_time(seen_ms)
        key = f"files/demo/{wheel('1.0')[0]}"
        assert proxy.catalog.publish_times[("pypi", key)].first_seen_ms == seen_ms
    # The first sight is never reset (a new process, the entries evicted).
    proxy.catalog.entries.clear()
    async with running(tmp_path, upstream, clock, COOLDOWN) as again:
        again.catalog.publish_times.update(proxy.catalog.publish_times)
        assert (await versions_offered(again))[1] == ["1.0"]


@pytest.mark.parametrize("unknown", ["allow", "deny"])
async def test_unknown_publish_time_allow_or_deny(tmp_path: Path, unknown: str) -> None:
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": None, "2.0": 30})
    policy = f'[policy]\ncooldown = "3d"\nunknown_publish_time = "{unknown}"\n'
    async with running(tmp_path, upstream, clock, policy) as proxy:
        expected = ["1.0", "2.0"] if unknown == "allow" else ["2.0"]
        assert (await versions_offered(proxy))[1] == expected


async def test_a_page_cached_as_json_serves_html_when_the_upstream_is_down(tmp_path: Path) -> None:
    """Found in issue 18: a page stored for one representation was not served to a
    client asking for the other while the upstream was down."""
    clock = ManualClock()
    upstream = Upstream(clock, {"1.0": 30})
    down = False

    def handler(request: UpstreamRequest) -> MockResponse:
        if down:
            return MockResponse(503, b"down")
        return upstream(request)

    for first, then in ((JSON_V1, "text/html"), ("text/html", JSON_V1)):
        async with running(tmp_path / first.replace("/", "_"), handler, clock) as proxy:
            down = False
            assert (
                await proxy.client.get("/pypi/simple/demo/", headers={"Accept": first})
            ).is_success
            clock.advance(601)  # expired
            down = True
            stale = await proxy.client.get("/pypi/simple/demo/", headers={"Accept": then})
            assert stale.status_code == 200
            assert stale.headers["content-type"].split(";")[0] == (
                JSON_V1 if then == JSON_V1 else "text/html"
            )
            assert stale.headers["warning"] == '110 - "Response is Stale"'
            assert wheel("1.0")[0] in stale.text

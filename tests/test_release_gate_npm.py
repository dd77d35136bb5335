"""The release policy on npm (proxy/policy/gate.py through proxy/formats/npm.py), in
memory: held and denied versions leave both representations of a packument (their
``time`` too), ``latest`` moves to the newest version left, and a tarball of such a
version is refused with a 403 npm shows (a JSON ``error``) naming the rule, cached or
not. Publish times are set relative to the engine's ManualClock; nothing sleeps."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.formats.simple_model import format_upload_time
from proxy.testing import InMemoryProxy
from tests.conftest import write_config
from tests.test_npm import ABBREVIATED, REGISTRY, TARBALLS, Upstream

pytestmark = pytest.mark.anyio

DAY_S = 86400
COOLDOWN = '[policy]\ncooldown = "3d"\n'
FULL = "application/json"


def aged(upstream: Upstream, clock: ManualClock, ages: dict[tuple[str, str], float]) -> None:
    """Each (package, version) published ``ages`` days before now."""
    for (name, version), age in ages.items():
        times = upstream.documents[name]["time"]
        times[version] = format_upload_time(clock.now_ms() - int(age * DAY_S * 1000))


def config(tmp_path: Path, policy: str, name: str = "proxy.toml") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        {policy}
        [[repositories]]
        name = "npm"
        format = "npm"
        upstream = "{REGISTRY}"
        """,
        name,
    )


@asynccontextmanager
async def running(
    tmp_path: Path, upstream: Upstream, clock: ManualClock, policy: str
) -> AsyncIterator[InMemoryProxy]:
    async with InMemoryProxy(load(config(tmp_path, policy), {}), upstream, clock) as proxy:
        yield proxy


async def both(proxy: InMemoryProxy, package: str) -> list[dict[str, Any]]:
    """The packument as npm install (abbreviated) and npm view (full) get it."""
    path = "/npm/" + package.replace("/", "%2f")
    documents = []
    for accept in (ABBREVIATED, FULL):
        response = await proxy.client.get(path, headers={"Accept": accept})
        assert response.status_code == 200, response.text
        documents.append(response.json())
    return documents


async def test_a_held_version_leaves_both_packuments_and_latest_moves(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream()
    aged(upstream, clock, {("left-pad", "1.0.0"): 30, ("left-pad", "1.1.0"): 1})
    async with running(tmp_path, upstream, clock, COOLDOWN) as proxy:
        for document in await both(proxy, "left-pad"):
            assert list(document["versions"]) == ["1.0.0"]
            assert document["dist-tags"] == {"latest": "1.0.0"}
        full = (await both(proxy, "left-pad"))[1]
        assert set(full["time"]) == {"1.0.0", "modified"}
        assert full["readme"] == "long text only the full document carries"
        # What is read from the packument (npm view, npm dist-tag ls) agrees.
        assert (await proxy.client.get("/npm/left-pad/latest")).json()["version"] == "1.0.0"
        assert (await proxy.client.get("/npm/left-pad/1.1.0")).status_code == 404
        tags = await proxy.client.get("/npm/-/package/left-pad/dist-tags")
        assert tags.json() == {"latest": "1.0.0"}
        # The hold ends: the version comes back, and latest with it.
        clock.advance(2 * DAY_S + 1)
        for document in await both(proxy, "left-pad"):
            assert list(document["versions"]) == ["1.0.0", "1.1.0"]
            assert document["dist-tags"] == {"latest": "1.1.0"}


async def test_a_held_tarball_is_refused_with_the_rule_cached_or_not(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream()
    aged(upstream, clock, {("left-pad", "1.0.0"): 30, ("left-pad", "1.1.0"): 1})
    held = "/npm/left-pad/-/left-pad-1.1.0.tgz"
    async with running(tmp_path, upstream, clock, "") as proxy:
        # No policy yet: the packument and the tarball are cached.
        assert list((await both(proxy, "left-pad"))[0]["versions"]) == ["1.0.0", "1.1.0"]
        got = await proxy.client.get(held)
        assert got.status_code == 200 and got.content == TARBALLS[("left-pad", "1.1.0")]
        etag = got.headers["etag"]
        fetched = len(proxy.upstream.requests)
        # A cooldown added while running applies to what is cached, with no refetch.
        proxy.engine.reload_policy(load(config(tmp_path, COOLDOWN, "reloaded.toml"), {}))
        for method, headers in (
            ("GET", {}),
            ("HEAD", {}),
            ("GET", {"range": "bytes=0-3"}),
            ("GET", {"if-none-match": etag}),
        ):
            refused = await proxy.client.request(method, held, headers=headers)
            assert refused.status_code == 403, (method, headers)
            if method == "GET":
                # npm shows the "error" of a JSON body.
                message = refused.json()["error"]
                assert "pkg:npm/left-pad@1.1.0 is held back until" in message
                assert "policy.cooldown" in message
        for document in await both(proxy, "left-pad"):
            assert list(document["versions"]) == ["1.0.0"]
            assert document["dist-tags"] == {"latest": "1.0.0"}
        assert len(proxy.upstream.requests) == fetched
        allowed = await proxy.client.get("/npm/left-pad/-/left-pad-1.0.0.tgz")
        assert allowed.status_code == 200


async def test_a_deny_rule_on_a_scoped_package_by_npm_version_range(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream()
    policy = """
    [[policy.rules]]
    match = "pkg:npm/%40acme/util"
    versions = "vers:npm/>=2.0.0|<3.0.0"
    action = "deny"
    reason = "compromised release, see INC-123"
    name = "inc-123"
    """
    async with running(tmp_path, upstream, clock, policy) as proxy:
        for document in await both(proxy, "@acme/util"):
            assert document["versions"] == {} and document["dist-tags"] == {}
        # Another package is not touched by the rule.
        assert list((await both(proxy, "left-pad"))[0]["versions"]) == ["1.0.0", "1.1.0"]
        tarball = "/npm/@acme/util/-/util-2.0.0.tgz"
        refused = await proxy.client.get(tarball)
        assert refused.status_code == 403
        assert "compromised release, see INC-123" in refused.json()["error"]
        problem = await proxy.client.get(tarball, headers={"Accept": "application/problem+json"})
        assert problem.status_code == 403
        document = json.loads(problem.content)
        assert document["type"] == "urn:artifact-proxy:release-policy:denied"
        assert document["package"] == "pkg:npm/%40acme/util" and document["version"] == "2.0.0"
        assert (document["rule"], document["setting"]) == ("inc-123", "policy.rules[0]")
        # The tarball was never asked of the upstream.
        assert not [r for r in proxy.upstream.requests if r.url.endswith(".tgz")]


async def test_report_mode_serves_every_version(tmp_path: Path) -> None:
    clock = ManualClock()
    upstream = Upstream()
    aged(upstream, clock, {("left-pad", "1.0.0"): 30, ("left-pad", "1.1.0"): 1})
    async with running(tmp_path, upstream, clock, COOLDOWN + 'mode = "report"\n') as proxy:
        for document in await both(proxy, "left-pad"):
            assert list(document["versions"]) == ["1.0.0", "1.1.0"]
            assert document["dist-tags"] == {"latest": "1.1.0"}
        got = await proxy.client.get("/npm/left-pad/-/left-pad-1.1.0.tgz")
        assert got.status_code == 200


async def test_a_lock_file_naming_a_held_tarball_is_refused_before_any_packument(
    tmp_path: Path,
) -> None:
    """``npm ci`` asks for the tarballs of its lock file, never for a packument: the
    publish time is read from the packument fetched through the cache for it."""
    clock = ManualClock()
    upstream = Upstream()
    aged(upstream, clock, {("left-pad", "1.0.0"): 30, ("left-pad", "1.1.0"): 1})
    async with running(tmp_path, upstream, clock, COOLDOWN) as proxy:
        refused = await proxy.client.get("/npm/left-pad/-/left-pad-1.1.0.tgz")
        assert refused.status_code == 403
        assert "is held back until" in refused.json()["error"]
        assert [r.url for r in proxy.upstream.requests] == [REGISTRY + "left-pad"]
        allowed = await proxy.client.get("/npm/left-pad/-/left-pad-1.0.0.tgz")
        assert allowed.content == TARBALLS[("left-pad", "1.0.0")]


async def test_a_version_without_a_time_is_given_its_first_sight(tmp_path: Path) -> None:
    """What a client's own release-age check (pnpm's minimumReleaseAge) reads, for a
    version the upstream states no time for; held by first-seen until the cooldown ends."""
    clock = ManualClock()
    upstream = Upstream()
    aged(upstream, clock, {("left-pad", "1.0.0"): 30})
    del upstream.documents["left-pad"]["time"]["1.1.0"]
    async with running(tmp_path, upstream, clock, "") as proxy:
        full = (await both(proxy, "left-pad"))[1]
        seen = format_upload_time(clock.now_ms()).removesuffix("Z")
        assert full["time"]["1.1.0"].startswith(seen[:19]) and full["time"]["1.1.0"][-1] == "Z"
        assert full["time"]["1.0.0"] == upstream.documents["left-pad"]["time"]["1.0.0"]
    async with running(tmp_path / "held", upstream, clock, COOLDOWN) as proxy:
        for document in await both(proxy, "left-pad"):
            assert list(document["versions"]) == ["1.0.0"]
        refused = await proxy.client.get("/npm/left-pad/-/left-pad-1.1.0.tgz")
        assert "(first-seen)" in refused.json()["error"], refused.json()

"""The release policy on Maven repositories, through the whole app in memory: the
versions of maven-metadata.xml (latest, release, lastUpdated recomputed, its checksum
that of the body served), a version's publish time from its pom's Last-Modified (asked
once through the cache, then kept), artifacts, checksums and HEAD of a held version
refused, SNAPSHOTs, and no pom asked for when lastUpdated settles it."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from email.utils import formatdate
from pathlib import Path

import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.formats.maven_metadata import parse_metadata
from proxy.testing import InMemoryProxy, MockResponse, UpstreamRequest
from tests.conftest import write_config

pytestmark = pytest.mark.anyio

M2 = "https://upstream.example/m2/"
BASE = "org/example/lib"
DAY_S = 86400


def metadata(versions: list[str], last_updated: str = "20991231000000") -> bytes:
    listed = "".join(f"<version>{v}</version>" for v in versions)
    return (
        "<metadata><groupId>org.example</groupId><artifactId>lib</artifactId><versioning>"
        f"<latest>{versions[-1]}</latest><release>{versions[-1]}</release>"
        f"<versions>{listed}</versions><lastUpdated>{last_updated}</lastUpdated>"
        "</versioning></metadata>"
    ).encode()


class Repository:
    """A Maven upstream whose versions' poms were published ``ages`` days before it was
    made (their Last-Modified)."""

    def __init__(self, clock: ManualClock, ages: dict[str, float], last_updated: str) -> None:
        self.made_s = clock.now_ms() / 1000
        self.ages = ages
        self.body = metadata(list(ages), last_updated)

    def __call__(self, request: UpstreamRequest) -> MockResponse:
        path = request.url.removeprefix(M2)
        if path == f"{BASE}/maven-metadata.xml":
            return MockResponse(200, self.body, {"content-type": "text/xml"})
        for version, age in self.ages.items():
            stem = f"{BASE}/{version}/lib-{version}"
            modified = formatdate(self.made_s - age * DAY_S, usegmt=True)
            body = f"{stem} body".encode()
            if path in (f"{stem}.pom", f"{stem}.jar"):
                return MockResponse(200, body, {"last-modified": modified})
            if path in (f"{stem}.pom.sha1", f"{stem}.jar.sha1"):
                return MockResponse(200, hashlib.sha1(body).hexdigest().encode())
        return MockResponse(404, b"not found")


@asynccontextmanager
async def running(
    tmp_path: Path, repository: Repository, clock: ManualClock, policy: str
) -> AsyncIterator[InMemoryProxy]:
    tmp_path.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - a test's own folder
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        {policy}
        [[repositories]]
        name = "maven"
        format = "maven"
        upstream = "{M2}"
        """,
    )
    async with InMemoryProxy(load(config, {}), repository, clock) as proxy:
        yield proxy


COOLDOWN = '[policy]\ncooldown = "3d"\n'


def poms_asked(proxy: InMemoryProxy) -> list[str]:
    return [r.url for r in proxy.upstream.requests if r.url.endswith(".pom")]


async def test_held_versions_leave_the_metadata_and_latest_release_are_recomputed(
    tmp_path: Path,
) -> None:
    clock = ManualClock()
    repository = Repository(clock, {"1.0": 30, "1.1": 10, "1.2": 1}, "20991231000000")
    async with running(tmp_path, repository, clock, COOLDOWN) as proxy:
        served = await proxy.client.get(f"/maven/{BASE}/maven-metadata.xml")
        assert served.status_code == 200
        found = parse_metadata(served.content, "served")
        assert found.versions == ["1.0", "1.1"]
        assert (found.latest, found.release) == ("1.1", "1.1")
        # lastUpdated is the newest publish time of what is left: 1.1's pom, 10 days ago.
        assert found.last_updated is not None and found.last_updated < "20991231000000"
        sha1 = await proxy.client.get(f"/maven/{BASE}/maven-metadata.xml.sha1")
        assert sha1.text == hashlib.sha1(served.content).hexdigest()
        assert served.headers["x-checksum-sha1"] == sha1.text
        # Each version's pom was asked for once, through the cache.
        assert sorted(poms_asked(proxy)) == sorted(
            f"{M2}{BASE}/{v}/lib-{v}.pom" for v in ("1.0", "1.1", "1.2")
        )
        await proxy.client.get(f"/maven/{BASE}/1.1/lib-1.1.pom")
        assert len(poms_asked(proxy)) == 3
        clock.advance(2 * DAY_S + 1)
        later = parse_metadata(
            (await proxy.client.get(f"/maven/{BASE}/maven-metadata.xml")).content, "later"
        )
        assert later.versions == ["1.0", "1.1", "1.2"] and later.latest == "1.2"
        # Nothing withheld: the upstream's own bytes (and so its checksums).
        assert (await proxy.client.get(f"/maven/{BASE}/maven-metadata.xml")).content == (
            repository.body
        )


async def test_a_held_version_is_refused_on_every_path(tmp_path: Path) -> None:
    clock = ManualClock()
    repository = Repository(clock, {"1.0": 30, "1.2": 1}, "20991231000000")
    async with running(tmp_path, repository, clock, COOLDOWN) as proxy:
        for method, path in (
            ("GET", f"{BASE}/1.2/lib-1.2.jar"),
            ("HEAD", f"{BASE}/1.2/lib-1.2.jar"),
            ("GET", f"{BASE}/1.2/lib-1.2.jar.sha1"),
            ("GET", f"{BASE}/1.2/lib-1.2.pom"),
            ("GET", f"{BASE}/1.2/lib-1.2.pom.md5"),
        ):
            refused = await proxy.client.request(method, f"/maven/{path}")
            assert refused.status_code == 403, (method, path)
            if method == "GET":
                assert "pkg:maven/org.example/lib@1.2 is held back until" in refused.text
                assert "(Last-Modified)" in refused.text
        # The pom was fetched (to learn when it was published), never the jar.
        assert not any(r.url.endswith("1.2.jar") for r in proxy.upstream.requests)
        allowed = await proxy.client.get(f"/maven/{BASE}/1.0/lib-1.0.jar")
        assert allowed.status_code == 200


async def test_a_poms_time_is_kept_once_learnt(tmp_path: Path) -> None:
    clock = ManualClock()
    repository = Repository(clock, {"1.0": 30}, "20991231000000")
    async with running(tmp_path, repository, clock, COOLDOWN) as proxy:
        assert (await proxy.client.get(f"/maven/{BASE}/1.0/lib-1.0.jar")).status_code == 200
        times = dict(proxy.catalog.publish_times)
    assert times[("maven", f"{BASE}/1.0/lib-1.0.pom")].upstream_ms is not None
    # Another process, the pom evicted: its time is known without asking.
    async with running(tmp_path, repository, clock, COOLDOWN) as again:
        again.catalog.publish_times.update(times)
        assert (await again.client.get(f"/maven/{BASE}/1.0/lib-1.0.jar")).status_code == 200
        assert poms_asked(again) == []


async def test_an_old_last_updated_spares_every_pom_lookup(tmp_path: Path) -> None:
    clock = ManualClock()
    repository = Repository(clock, {"1.0": 30, "1.1": 20}, "20200101000000")
    async with running(tmp_path, repository, clock, COOLDOWN) as proxy:
        served = await proxy.client.get(f"/maven/{BASE}/maven-metadata.xml")
        assert served.content == repository.body
        assert poms_asked(proxy) == []


async def test_deny_rules_by_maven_version_range_and_snapshots(tmp_path: Path) -> None:
    clock = ManualClock()
    repository = Repository(clock, {"1.0": 30, "1.5": 20, "2.0-SNAPSHOT": 10}, "20991231000000")
    policy = """
    [[policy.rules]]
    match = "pkg:maven/org.example/lib"
    versions = "vers:maven/>=1.1|<1.9"  # 2.0-SNAPSHOT is below 2.0, not below 1.9
    action = "deny"
    reason = "INC-9"
    [[policy.rules]]
    match = "pkg:maven/org.example/lib"
    versions = "vers:maven/>=2.0-SNAPSHOT"
    action = "deny"
    reason = "no snapshots"
    """
    async with running(tmp_path, repository, clock, policy) as proxy:
        found = parse_metadata(
            (await proxy.client.get(f"/maven/{BASE}/maven-metadata.xml")).content, "served"
        )
        assert found.versions == ["1.0"] and found.latest == found.release == "1.0"
        refused = await proxy.client.get(f"/maven/{BASE}/1.5/lib-1.5.jar")
        assert refused.status_code == 403 and "INC-9" in refused.text
        snapshot = await proxy.client.get(
            f"/maven/{BASE}/2.0-SNAPSHOT/maven-metadata.xml",
            headers={"Accept": "application/problem+json"},
        )
        assert snapshot.status_code == 403
        assert snapshot.json()["reason"] == "no snapshots"
        # Rules alone decide: no pom was asked for.
        assert poms_asked(proxy) == []

"""Cache-Control on every answer (proxy/http/responses.py), so a CDN or the load balancer in
front can absorb hits: immutable files forever, metadata for what is left of its TTL,
computed and stale answers revalidated, errors and uploads never stored."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx

from proxy.clock import ManualClock
from proxy.config.load import load
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.upstream import FakeUpstream, ProjectFile

IMMUTABLE = "public, max-age=31536000, immutable"


def test_cache_control_follows_what_the_answer_is(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    f = ProjectFile("alpha-1.0.tar.gz", b"alpha" * 100_000)
    upstream.add_project("alpha", [f])
    extra = """
    [[repositories]]
    name = "maven"
    format = "maven"
    upstream = "UPSTREAM/"
    [[repositories]]
    name = "cache"
    format = "gradle-build-cache"
    anonymous = "write"
    """.replace("UPSTREAM", upstream.base_url)
    config = pypi_config(tmp_path / "data", upstream.base_url) + extra
    clock = ManualClock()
    proxy = start_proxy(load(write_config(tmp_path, config), {}), clock)
    url = proxy.url

    page = httpx.get(url + "/pypi/simple/alpha/")
    assert page.headers["cache-control"] == "public, max-age=600"  # metadata_ttl 10m
    clock.advance(240)
    assert httpx.get(url + "/pypi/simple/alpha/").headers["cache-control"] == "public, max-age=360"

    streamed = httpx.get(url + f"/pypi/files/alpha/{f.filename}")  # the miss itself
    assert streamed.content == f.body and streamed.headers["cache-control"] == IMMUTABLE
    hit = httpx.get(url + f"/pypi/files/alpha/{f.filename}")
    assert hit.headers["cache-control"] == IMMUTABLE
    not_modified = httpx.get(
        url + f"/pypi/files/alpha/{f.filename}", headers={"If-None-Match": hit.headers["etag"]}
    )
    assert not_modified.status_code == 304 and not_modified.headers["cache-control"] == IMMUTABLE

    clock.advance(600)
    upstream.fault("/simple/alpha/", status=500)
    stale = httpx.get(url + "/pypi/simple/alpha/")
    assert "110" in stale.headers["warning"] and stale.headers["cache-control"] == "no-cache"
    upstream.clear_faults()

    for path in ("/pypi/simple", "/pypi/simple/Alpha/", "/pypi/simple/alpha"):
        moved = httpx.get(url + path)  # a name normalized: the same answer every time
        assert (
            moved.status_code == 301 and moved.headers["cache-control"] == "public, max-age=86400"
        )

    missing = httpx.get(url + "/pypi/simple/nothing-here/")
    assert missing.status_code == 404 and missing.headers["cache-control"] == "no-store"
    bad = httpx.get(url + "/pypi/simple/bad%20name/")
    assert bad.status_code == 400 and bad.headers["cache-control"] == "no-store"

    jar = "/org/example/lib/1.0/lib-1.0.jar"
    upstream.files[jar] = b"jar"
    upstream.files[jar + ".sha1"] = hashlib.sha1(b"jar").hexdigest().encode()
    assert httpx.get(url + "/maven" + jar).headers["cache-control"] == IMMUTABLE
    checksum = httpx.get(url + "/maven" + jar + ".sha1")
    assert checksum.text == hashlib.sha1(b"jar").hexdigest()
    assert checksum.headers["cache-control"] == "no-cache"

    put = httpx.put(url + "/cache/key1", content=b"output")
    assert put.status_code == 201 and put.headers["cache-control"] == "no-store"
    assert httpx.get(url + "/cache/key1").headers["cache-control"] == "no-store"


def test_a_changed_metadata_ttl_governs_stored_pages_at_once(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """A page stored under a 10-minute TTL, served by a proxy restarted with 3 s: the
    current TTL decides its freshness and its max-age (it never exceeds 3 s)."""
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    clock = ManualClock()
    long_ttl = pypi_config(tmp_path / "data", upstream.base_url)
    first = start_proxy(load(write_config(tmp_path, long_ttl, "long.toml"), {}), clock)
    assert httpx.get(first.url + "/pypi/simple/alpha/").headers["cache-control"] == (
        "public, max-age=600"
    )
    first.stop()
    short_ttl = long_ttl.replace('metadata_ttl = "10m"', 'metadata_ttl = "3s"')
    second = start_proxy(load(write_config(tmp_path, short_ttl, "short.toml"), {}), clock)
    clock.advance(1)
    page = httpx.get(second.url + "/pypi/simple/alpha/")
    assert page.headers["cache-control"] == "public, max-age=2"
    assert upstream.count("/simple/alpha/") == 1  # still fresh under 3 s
    clock.advance(3)
    refreshed = httpx.get(second.url + "/pypi/simple/alpha/")
    assert upstream.count("/simple/alpha/") == 2  # expired under the new TTL: refetched
    assert refreshed.headers["cache-control"] == "public, max-age=3"


def test_a_wall_clock_that_steps_back_never_stretches_freshness(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    # Issue 18: the clock stepping back a day made a 10-minute page answer
    # max-age=86998, and kept it fresh for that long.
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    config = pypi_config(tmp_path / "data", upstream.base_url)
    clock = ManualClock()
    proxy = start_proxy(load(write_config(tmp_path, config), {}), clock)
    url = proxy.url + "/pypi/simple/alpha/"
    assert httpx.get(url).headers["cache-control"] == "public, max-age=600"
    asked = upstream.count("/simple/alpha/")
    clock.step_wall(-30)  # NTP's small corrections (and replicas' skew) change nothing
    small = httpx.get(url)
    assert small.headers["cache-control"] == "public, max-age=600"
    assert upstream.count("/simple/alpha/") == asked
    clock.step_wall(-86400)  # a day back: judged stale, asked again, the TTL as it is
    stepped = httpx.get(url)
    assert stepped.status_code == 200 and upstream.count("/simple/alpha/") == asked + 1
    max_age = int(stepped.headers["cache-control"].rsplit("=", 1)[1])
    assert max_age <= 600
    clock.step_wall(86400 + 300)  # and forward again: still never more than the TTL
    later = httpx.get(url)
    assert int(later.headers["cache-control"].rsplit("=", 1)[1]) <= 600

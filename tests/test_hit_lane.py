"""The hit lane (proxy/http/lane.py): a fresh hit's answer kept by the protocol, sent
again without the app, exactly as the full path would answer, and gone the moment the
full path would answer otherwise."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.http.lane import HitLane
from tests.admin_support import AUTH, admin_config
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.upstream import FakeUpstream, ProjectFile, ServerThread

JSON_V1 = "application/vnd.pypi.simple.v1+json"
HTML_V1 = "application/vnd.pypi.simple.v1+html"


def lane_of(proxy: ServerThread) -> HitLane:
    lane = proxy.server.lifespan.state["lane"]
    assert isinstance(lane, HitLane)
    return lane


def filed(client: httpx.Client, lane: HitLane, url: str, **kw: Any) -> httpx.Response:
    """GET ``url`` until its answer is in the lane (the full path's hits file it; the
    miss's own fetch may still replace the entry it was made of, just after the miss's
    last byte): the full path's last answer. ``lane.answered`` is left as it was."""
    answered = lane.answered
    full = client.get(url, **kw)
    for _ in range(10):
        probe = client.get(url, **kw)
        if lane.answered > answered:
            lane.answered = answered  # tests count what they send after this
            return full
        full = probe
    raise AssertionError(f"{url}: never answered by the lane")


def same_answer(a: httpx.Response, b: httpx.Response) -> None:
    """Status, body and every header but Date (and its order) the same."""
    assert a.status_code == b.status_code
    assert a.content == b.content
    assert [(k, v) for k, v in a.headers.multi_items() if k != "date"] == [
        (k, v) for k, v in b.headers.multi_items() if k != "date"
    ]
    assert "date" in a.headers and "date" in b.headers


@pytest.fixture
def project(upstream: FakeUpstream) -> ProjectFile:
    f = ProjectFile("alpha-1.0-py3-none-any.whl", b"wheel" * 2000)
    upstream.add_project("alpha", [f])
    return f


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def proxy(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory, clock: ManualClock
) -> ServerThread:
    config = write_config(tmp_path, pypi_config(tmp_path / "data", upstream.base_url))
    return start_proxy(load(config, {}), clock)


def test_a_file_hit_is_answered_by_the_lane_as_the_full_path_answers_it(
    proxy: ServerThread, upstream: FakeUpstream, project: ProjectFile
) -> None:
    url = f"{proxy.url}/pypi/files/alpha/{project.filename}"
    lane = lane_of(proxy)
    with httpx.Client() as client:
        assert client.get(url).content == project.body  # the miss
        full = filed(client, lane, url)  # a hit on the full path: its answer is filed
        assert lane.answered == 0 and len(lane) == 1
        laned = client.get(url)
        assert lane.answered == 1
        same_answer(full, laned)
        head_full_path = client.head(url, headers={"Range": "bytes=0-"})  # a Range: full path
        assert head_full_path.status_code == 206 and lane.answered == 1
        head = client.head(url)
        assert lane.answered == 2 and head.content == b""
        assert head.headers["content-length"] == str(len(project.body))
        not_modified = client.get(url, headers={"If-None-Match": laned.headers["etag"]})
        assert not_modified.status_code == 304 and lane.answered == 3
        assert "content-length" not in not_modified.headers
        other_etag = client.get(url, headers={"If-None-Match": '"other"'})
        assert other_etag.status_code == 200 and other_etag.content == project.body
        assert lane.answered == 4
        # A revalidating cache (the shipped nginx) sends both: If-None-Match decides.
        both = {
            "If-None-Match": laned.headers["etag"],
            "If-Modified-Since": "Thu, 01 Jan 1970 00:00:00 GMT",
        }
        revalidated = client.get(url, headers=both)
        assert revalidated.status_code == 304 and lane.answered == 5
        since = client.get(url, headers={"If-Modified-Since": laned.headers["last-modified"]})
        assert since.status_code == 304 and lane.answered == 5  # alone: the full path's
        ranged = client.get(url, headers={"Range": "bytes=0-9"})
        assert ranged.status_code == 206 and ranged.content == project.body[:10]
        assert lane.answered == 5  # a range: the full path's
    assert upstream.count(f"/packages/{project.filename}") == 1


def test_lane_answers_count_and_log_as_the_full_path_does(
    proxy: ServerThread, project: ProjectFile, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"{proxy.url}/pypi/files/alpha/{project.filename}"
    with httpx.Client() as client:
        filed(client, lane_of(proxy), url)

        def counted() -> tuple[float, float, float]:
            text = client.get(f"{proxy.url}/metrics").text
            values = []
            for series in (
                'proxy_http_requests_total{method="GET",repository="pypi",status="200"}',
                'proxy_cache_hits_total{format="pypi",kind="immutable",repository="pypi"}',
                'proxy_bytes_served_total{repository="pypi"}',
            ):
                line = next(x for x in text.splitlines() if x.startswith(series))
                values.append(float(line.rsplit(" ", 1)[1]))
            return values[0], values[1], values[2]

        before = counted()
        caplog.set_level(logging.INFO, logger="proxy.access")
        client.get(url)
        after = counted()  # (the line is written just after the answer's last byte)
    assert lane_of(proxy).answered == 1
    assert after[0] - before[0] == 1 and after[1] - before[1] == 1
    assert after[2] - before[2] == len(project.body)
    [line] = [
        r.getMessage()
        for r in caplog.records
        if r.name == "proxy.access" and project.filename in r.getMessage()
    ]
    assert f'"GET /pypi/files/alpha/{project.filename}" 200 {len(project.body)}' in line
    assert line.endswith(" hit")


def test_pages_are_kept_per_accept_and_count_their_max_age_down(
    proxy: ServerThread, upstream: FakeUpstream, project: ProjectFile, clock: ManualClock
) -> None:
    url = f"{proxy.url}/pypi/simple/alpha/"
    lane = lane_of(proxy)
    with httpx.Client() as client:
        for accept in (JSON_V1, HTML_V1):
            filed(client, lane, url, headers={"Accept": accept})
        assert lane.answered == 0 and len(lane) == 2
        as_json = client.get(url, headers={"Accept": JSON_V1})
        as_html = client.get(url, headers={"Accept": HTML_V1})
        assert lane.answered == 2
        assert as_json.headers["content-type"] == JSON_V1 and as_json.json()["name"] == "alpha"
        assert as_html.headers["content-type"] == HTML_V1 and b"<html" in as_html.content
        assert as_json.headers["vary"] == "Accept"
        assert as_json.headers["cache-control"] == "public, max-age=600"
        clock.advance(250.5)
        later = client.get(url, headers={"Accept": JSON_V1})
        assert lane.answered == 3 and later.headers["cache-control"] == "public, max-age=349"
        twice = client.get(url, headers=[("Accept", JSON_V1), ("Accept", HTML_V1)])
        assert twice.status_code == 200 and lane.answered == 3  # joined: the full path's
        pages = upstream.count("/simple/alpha/")
        clock.advance(400)  # expired: the full path asks the upstream again
        client.get(url, headers={"Accept": JSON_V1})
        assert lane.answered == 3 and upstream.count("/simple/alpha/") == pages + 1


def test_a_purged_entry_is_never_answered_from_the_lane(
    tmp_path: Path, upstream: FakeUpstream, start_proxy: ProxyFactory, project: ProjectFile
) -> None:
    proxy = start_proxy(load(admin_config(tmp_path, upstream.base_url), {}))
    url = f"{proxy.url}/pypi/files/alpha/{project.filename}"
    lane = lane_of(proxy)
    with httpx.Client() as client:
        filed(client, lane, url)
        assert client.get(url).status_code == 200
        assert lane.answered == 1
        purged = client.delete(f"{proxy.url}/api/v1/packages/pypi/alpha", auth=AUTH)
        assert purged.status_code == 200, purged.text
        assert client.get(url).status_code == 200
        assert lane.answered == 1, "a purged entry was answered from the lane"
        assert upstream.count(f"/packages/{project.filename}") == 2


def test_a_policy_reload_empties_the_lane(proxy: ServerThread, project: ProjectFile) -> None:
    url = f"{proxy.url}/pypi/files/alpha/{project.filename}"
    lane = lane_of(proxy)
    with httpx.Client() as client:
        filed(client, lane, url)
        engine = proxy.server.lifespan.state["proxy"]
        engine.reload_policy(engine.settings)
        assert len(lane) == 0
        client.get(url)
        assert lane.answered == 0


def test_pipelined_requests_are_answered_in_order_around_the_full_path(
    proxy: ServerThread, project: ProjectFile
) -> None:
    """A lane answer never overtakes a full-path answer before it on the connection."""
    path = f"/pypi/files/alpha/{project.filename}"
    with httpx.Client() as client:
        filed(client, lane_of(proxy), proxy.url + path)
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    slow = b"GET /pypi/simple/alpha/ HTTP/1.1\r\nHost: x\r\nAccept: text/html\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(request + slow + request)
        sock.settimeout(10)
        received = b""
        while received.count(b"HTTP/1.1 ") < 3 or not received.endswith(project.body):
            chunk = sock.recv(65536)
            assert chunk, received[-200:]
            received += chunk
    statuses = [part.split(b"\r\n", 1)[0] for part in received.split(b"HTTP/1.1 ")[1:]]
    assert statuses == [b"200 OK"] * 3
    first_page = received.index(b"<html")
    assert received.index(project.body) < first_page < received.rindex(project.body)


def test_requests_the_lane_leaves_to_the_full_path(
    proxy: ServerThread, project: ProjectFile
) -> None:
    path = f"/pypi/files/alpha/{project.filename}"
    lane = lane_of(proxy)
    with httpx.Client() as client:
        filed(client, lane, proxy.url + path)

    async def raw(request: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(1 << 20), 10)
        writer.close()
        return data

    with httpx.Client() as client:
        for i in range(3):  # a query string: never filed (no client sends one)
            assert client.get(f"{proxy.url}{path}?spelling={i}").status_code == 200
            assert client.get(f"{proxy.url}{path}?spelling={i}").status_code == 200
    assert len(lane) == 1
    for request in (
        f"GET {path} HTTP/1.0\r\n\r\n",  # HTTP/1.0
        f"GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        f"GET {path} HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",  # two Hosts: a 400
        f"GET {path} HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc",
        f"GET {path} HTTP/1.1\r\nHost: a\r\nIf-Modified-Since: Thu, 01 Jan 2099 00:00:00 GMT"
        "\r\nConnection: close\r\n\r\n",
    ):
        answer = asyncio.run(raw(request.encode()))
        assert answer.startswith(b"HTTP/1."), answer[:100]
    assert lane.answered == 0


def test_batched_counts_add_up_as_one_by_one_observations_would() -> None:
    """``metrics.Batched`` adds to prometheus_client's values through the histogram's
    private layout (``_sum``, ``_buckets``, ``_upper_bounds``): a changed layout fails
    here, not in production."""
    from prometheus_client import CollectorRegistry, Counter, Histogram

    from proxy.runtime.metrics import Batched

    registry = CollectorRegistry()
    buckets = (0.001, 0.01, 0.1, 1.0)
    one = Histogram("one_seconds", "d", buckets=buckets, registry=registry)
    many = Histogram("many_seconds", "d", buckets=buckets, registry=registry)
    requests = Counter("req", "r", registry=registry)
    sent = Counter("sent", "s", registry=registry)
    batched = Batched(requests, many, sent)
    samples = [0.0004, 0.0009, 0.002, 0.05, 0.5, 3.0, 0.001]
    for seconds in samples:
        one.observe(seconds)
        batched.add(seconds, 10)
    assert registry.get_sample_value("req_total") == 0  # not yet
    batched.flush()
    batched.flush()  # nothing twice
    for suffix in ("_count", "_sum"):
        assert registry.get_sample_value(f"many_seconds{suffix}") == registry.get_sample_value(
            f"one_seconds{suffix}"
        )
    for bound in ("0.001", "0.01", "0.1", "1.0", "+Inf"):
        assert registry.get_sample_value(
            "many_seconds_bucket", {"le": bound}
        ) == registry.get_sample_value("one_seconds_bucket", {"le": bound})
    assert registry.get_sample_value("req_total") == len(samples)
    assert registry.get_sample_value("sent_total") == 10 * len(samples)

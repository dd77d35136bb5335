"""Outage memory (proxy/upstream/circuit.py): while an upstream is down, stale copies are
served at once and misses fail fast with a 503 and Retry-After, instead of each request
paying a timeout; one probe per backoff window finds out when it is back (issue 18)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.config.settings import UpstreamSettings
from proxy.exceptions import UpstreamDown, UpstreamError
from proxy.http.errors import rule_for
from proxy.upstream import circuit as circuit_module
from proxy.upstream import client as client_module
from proxy.upstream.circuit import BACKOFF_MAX_S, FAILURES_TO_OPEN, Circuit, State
from proxy.upstream.client import UpstreamPool
from tests.conftest import ProxyFactory, pypi_config, write_config
from tests.processes import metric_value
from tests.upstream import FakeUpstream, ProjectFile, start_upstream


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def state_of(circuit: Circuit) -> State:
    """The state now (read through a call: mypy would keep an earlier comparison's
    narrowing of ``circuit.state`` across the calls that change it)."""
    return circuit.state


def test_a_circuit_opens_probes_once_and_closes() -> None:
    clock = FakeTime()
    c = Circuit("up.example", clock)
    for _ in range(FAILURES_TO_OPEN - 1):
        assert c.admit() is False
        c.failed("connection refused", probe=False)
    assert state_of(c) is State.CLOSED
    c.failed("connection refused", probe=False)
    assert state_of(c) is State.OPEN
    with pytest.raises(UpstreamDown) as refused:
        c.admit()
    assert rule_for(refused.value).status == 503 and refused.value.retry_after_s is not None
    assert "up.example is down (last failure: connection refused)" in str(refused.value)
    first_window = c.retry_at - clock.now
    clock.now = c.retry_at
    assert c.admit() is True  # the one probe
    assert state_of(c) is State.HALF_OPEN
    with pytest.raises(UpstreamDown):
        c.admit()  # the others still fail fast while it is out
    c.failed("timed out", probe=True)
    assert state_of(c) is State.OPEN and c.retry_at - clock.now > first_window  # backs off
    c.failed("late", probe=False)  # a request sent before: the window stands
    clock.now = c.retry_at
    assert c.admit() is True
    c.succeeded(probe=True)
    assert state_of(c) is State.CLOSED and c.admit() is False and c.failures == 0


def test_backoff_is_bounded_and_a_probe_without_verdict_lets_another_go() -> None:
    clock = FakeTime()
    c = Circuit("up.example", clock)
    for _ in range(FAILURES_TO_OPEN):
        c.failed("down", probe=False)
    for _ in range(20):
        clock.now = c.retry_at
        assert c.admit() is True
        c.failed("down", probe=True)
    assert c.retry_at - clock.now <= BACKOFF_MAX_S
    clock.now = c.retry_at
    assert c.admit() is True
    c.release(probe=True)  # refused by our policy, or cancelled: no verdict
    assert c.admit() is True


def test_an_upstream_that_is_down_costs_no_more_requests_stale_pages_go_at_once(
    tmp_path: Path,
    upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(circuit_module, "BACKOFF_MIN_S", 3.0)  # longer than the loop below
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"a" * 1000)])
    upstream.add_project("beta", [ProjectFile("beta-1.0.tar.gz", b"b" * 1000)])
    clock = ManualClock()
    config = pypi_config(tmp_path / "data", upstream.base_url)
    proxy = start_proxy(load(write_config(tmp_path, config), {}), clock)
    host = upstream.base_url.removeprefix("http://")
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        assert client.get("/pypi/simple/alpha/").status_code == 200
        clock.advance(3600)  # the page has expired
        upstream.fault("/simple/alpha/", status=500)
        upstream.fault("/simple/beta/", status=500)
        for _ in range(FAILURES_TO_OPEN):
            stale = client.get("/pypi/simple/alpha/")
            assert stale.status_code == 200 and "110" in stale.headers["warning"]
        asked = upstream.count("/simple/alpha/")
        # Down: stale copies at once, misses fail fast, and the upstream is not asked.
        for _ in range(10):
            stale = client.get("/pypi/simple/alpha/")
            assert stale.status_code == 200 and "110" in stale.headers["warning"]
        miss = client.get("/pypi/simple/beta/")
        assert miss.status_code == 503 and int(miss.headers["retry-after"]) >= 1
        assert f"upstream {host} is down" in miss.text
        assert upstream.count("/simple/alpha/") == asked and upstream.count("/simple/beta/") == 0
        ready = client.get("/readyz")
        assert f"upstream {host} is down" in ready.text
        assert (
            metric_value(client.get("/metrics").text, "proxy_upstream_circuit_state", host=host)
            == 2
        )
        # Back: after the window one probe goes out, and the fresh page is served.
        upstream.clear_faults()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            fresh = client.get("/pypi/simple/alpha/")
            if "warning" not in fresh.headers:
                break
            time.sleep(0.2)
        assert fresh.status_code == 200 and "warning" not in fresh.headers
        assert client.get("/pypi/simple/beta/").status_code == 200
        assert "is down" not in client.get("/readyz").text
        assert (
            metric_value(client.get("/metrics").text, "proxy_upstream_circuit_state", host=host)
            == 0
        )


def test_an_upstream_redirecting_to_ever_new_hosts_grows_no_table_or_label_without_bound(
    upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every host a redirect named got a circuit, a transfer slot, a health record (in
    the heartbeat row, the console and /api/v1/stats) and label values of
    proxy_upstream_circuit_state and proxy_upstream_errors_total, for ever: an upstream
    redirecting each file to a host of its own grew them all by one per request."""
    monkeypatch.setattr(client_module, "MAX_HOSTS", 20, raising=False)
    tag = f"t{time.monotonic_ns()}"
    for i in range(60):
        upstream.fault(f"/releases/f{i}", redirect_to=f"http://h{i}-{tag}.invalid/f")
    failing = FakeUpstream()
    failing.fault("/down", status=503)
    down = start_upstream(failing)
    down_host = down.url.split("//", 1)[1]

    async def scenario() -> UpstreamPool:
        pool = UpstreamPool(UpstreamSettings(retries=0))
        urls = (upstream.base_url + "/releases/", down.url + "/")
        client = pool.for_repository("tools", urls)
        try:
            for _ in range(FAILURES_TO_OPEN):  # a configured host's outage is kept
                with pytest.raises(UpstreamError):
                    async with client.open("GET", down.url + "/down"):
                        pass
            for i in range(60):
                with pytest.raises(UpstreamError):
                    async with client.open("GET", f"{upstream.base_url}/releases/f{i}"):
                        pass
        finally:
            await pool.aclose()
        return pool

    try:
        pool = asyncio.run(scenario())
    finally:
        down.stop()
    assert len(pool.circuits) <= 20 and len(pool.health.hosts) <= 20
    assert len(pool._slots) <= 20
    assert pool.circuits[down_host].state is not State.CLOSED, "an open circuit is kept"
    exposed = generate_latest(REGISTRY).decode()
    for metric in ("proxy_upstream_circuit_state", "proxy_upstream_errors_total"):
        labelled = set(re.findall(rf'{metric}{{host="(h\d+-{tag}\.invalid)"', exposed))
        assert len(labelled) <= 20, (metric, len(labelled))

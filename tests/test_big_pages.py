"""Index pages of a real index's size, served by a real `proxy serve` while cache hits
go on (proxy/formats/pypi.py, proxy/runtime/blocking.py CpuPool): the pages are parsed and
rendered off the event loop, hits stay fast, and memory stays bounded.

The bounds asserted here are loose on purpose (this machine is shared and noisy): how
much the process grows, that the pages went to a child process, and that the event loop
never stalled for seconds; how long a hit took is printed, not asserted. bench/big_pages.py
prints the real figures.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import hostile
from tests.conftest import write_config
from tests.hostile import HostileUpstream
from tests.processes import ProxyProcess, child_pids, metric_value
from tests.upstream import FakeUpstream

pytestmark = pytest.mark.slow

PROJECTS = 600_000
FILES = 100_000
JSON_V1 = "application/vnd.pypi.simple.v1+json"


def root_page() -> bytes:
    """A root page the size of a real index's (about 38 MB of HTML)."""
    rows = "".join(
        f'<a href="/simple/project-{i:06d}/">project-{i:06d}</a>\n' for i in range(PROJECTS)
    )
    return f"<!DOCTYPE html><html><body>\n{rows}</body></html>\n".encode()


def project_page() -> bytes:
    files = [
        {
            "filename": f"huge-{i}.0-py3-none-any.whl",
            "url": f"/packages/huge-{i}.0-py3-none-any.whl",
            "hashes": {"sha256": f"{i:064x}"},
            "requires-python": ">=3.8",
        }
        for i in range(FILES)
    ]
    return json.dumps({"meta": {"api-version": "1.0"}, "name": "huge", "files": files}).encode()


@pytest.fixture
def big_index() -> Iterator[HostileUpstream]:
    server = HostileUpstream()
    server.routes["/simple/"] = hostile.ok(root_page(), b"text/html")
    server.routes["/simple/huge/"] = hostile.ok(project_page(), JSON_V1.encode())
    server.start()
    yield server
    server.stop()


def test_big_pages_are_served_while_hits_stay_fast(
    tmp_path: Path, big_index: HostileUpstream, upstream: FakeUpstream
) -> None:
    upstream.files["/hit.bin"] = b"h" * 20_000
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [upstream]
        read_timeout = "60s"
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "{big_index.base_url}/simple/"
        [[repositories]]
        name = "files"
        format = "raw"
        upstream = "{upstream.base_url}/"
        """,
    )
    proxy = ProxyProcess(config, tmp_path, "big").start().wait_ready()
    try:
        with httpx.Client(timeout=10) as hits:
            assert hits.get(proxy.url + "/files/hit.bin").status_code == 200
            # What the pages add, not the total: the process at rest grows with every
            # library the proxy loads (an S3 client, a template engine), none of it
            # held per page. 100,000 files parsed and rendered took 234 MiB here.
            at_rest = proxy.rss_mib()
            # One big page at a time: the root page (the case), then a project
            # page of 100,000 files; hits every 20 ms meanwhile.
            for path in ("/pypi/simple/", "/pypi/simple/huge/"):
                slowest_hit, peak_rss, page = _fetch_during_hits(proxy, hits, path)
                grown = peak_rss - at_rest
                print(
                    f"{path}: slowest hit {slowest_hit * 1000:.0f} ms,"
                    f" RSS {at_rest:.0f} MiB at rest, +{grown:.0f} MiB at the peak"
                )
                assert page.status_code == 200, page.text[:200]
                assert grown < 256, f"RSS grew by {grown:.0f} MiB with {path}"
        root = httpx.get(proxy.url + "/pypi/simple/", headers={"Accept": JSON_V1}, timeout=60)
        assert len(root.json()["projects"]) == PROJECTS
        html = httpx.get(proxy.url + "/pypi/simple/", headers={"Accept": "text/html"}, timeout=60)
        assert html.status_code == 200 and html.text.count("<a ") == PROJECTS
        huge = httpx.get(proxy.url + "/pypi/simple/huge/", headers={"Accept": JSON_V1}, timeout=60)
        assert len(huge.json()["files"]) == FILES
        # Where the work ran, not how long the loop waited: parsed in the server, the
        # page would have stalled its loop for seconds (normalizing it alone takes 3.8 s
        # here); in a thread, for each json.loads or json.dumps of it. A loop that waited
        # half a second once happened on a busy CI machine with the pages in a child.
        assert _page_parsers(proxy.pid), "the big pages were not handed to a child process"
        text = httpx.get(proxy.url + "/metrics").text
        probes = metric_value(text, "proxy_event_loop_lag_seconds_count")
        on_time = metric_value(text, "proxy_event_loop_lag_seconds_bucket", le="2.5")
        assert probes > 10 and on_time == probes, "the event loop stalled for seconds"
        assert big_index.requests["/simple/huge/"] == 1
    finally:
        proxy.stop()


def _page_parsers(pid: int) -> list[int]:
    """The server's child processes started by multiprocessing (its page parsers)."""
    parsers = []
    for child in child_pids(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--multiprocessing-fork" in argv:
            parsers.append(child)
    return parsers


def _fetch_during_hits(
    proxy: ProxyProcess, hits: httpx.Client, path: str
) -> tuple[float, float, httpx.Response]:
    result: list[httpx.Response] = []
    page = threading.Thread(
        target=lambda: result.append(
            httpx.get(proxy.url + path, headers={"Accept": JSON_V1}, timeout=120)
        )
    )
    page.start()
    slowest_hit = 0.0
    peak_rss = proxy.rss_mib()
    deadline = time.monotonic() + 120
    while page.is_alive() and time.monotonic() < deadline:
        started = time.monotonic()
        assert hits.get(proxy.url + "/files/hit.bin").status_code == 200
        slowest_hit = max(slowest_hit, time.monotonic() - started)
        peak_rss = max(peak_rss, proxy.rss_mib())
        time.sleep(0.02)
    page.join(5)
    return slowest_hit, peak_rss, result[0]


def test_sigterm_does_not_wait_for_a_page_being_parsed(tmp_path: Path) -> None:
    # 120 KB of "<a " takes CPython's HTMLParser minutes; a thread busy with it held
    # the process's exit that long. In a child process it is killed at shutdown.
    index = HostileUpstream()
    index.routes["/simple/evil/"] = hostile.ok(b"<a " * 40_000, b"text/html")
    index.start()
    config = write_config(
        tmp_path,
        f"""
        [storage]
        path = "{tmp_path / "data"}"
        [upstream]
        parse_timeout = "10m"
        [[repositories]]
        name = "pypi"
        format = "pypi"
        upstream = "{index.base_url}/simple/"
        """,
    )
    proxy = ProxyProcess(config, tmp_path, "parsing").start().wait_ready()
    try:
        threading.Thread(
            target=lambda: httpx.get(proxy.url + "/pypi/simple/evil/", timeout=120), daemon=True
        ).start()
        deadline = time.monotonic() + 30
        while index.requests["/simple/evil/"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the page is read and handed to its parser
        proxy.signal(signal.SIGTERM)
        assert proxy.wait(20) in (0, -signal.SIGTERM), proxy.log()[-2000:]
    finally:
        proxy.stop()
        index.stop()

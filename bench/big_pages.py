"""Index pages of a real index's size while cache hits go on (issue: hostile upstreams).

    .venv/bin/python -m bench.big_pages

For each scenario a fresh proxy process fetches the pages from a local upstream while a
client sends a cache hit every 10 ms; prints the hit latencies (p50, p99, max), the
worst event-loop lag the proxy measured, and the proxy's peak RSS.
Scenarios: the root page of 600,000 projects (JSON), the same page in both
representations at once, and a project page of 100,000 files.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.common import rss_kib, start_proxy, workdir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import hostile
from tests.processes import child_pids
from tests.test_big_pages import JSON_V1, project_page, root_page
from tests.upstream import FakeUpstream, start_upstream

SCENARIOS = {
    "root page, 600k projects": [("/pypi/simple/", JSON_V1)],
    "root page, JSON and HTML at once": [
        ("/pypi/simple/", JSON_V1),
        ("/pypi/simple/", "text/html"),
    ],
    "project page, 100k files": [("/pypi/simple/huge/", JSON_V1)],
}


def children_rss_kib(pid: int) -> int:
    """RSS of the proxy's child processes (the parse process), in KiB."""
    total = 0
    for child in child_pids(pid):
        try:
            total += rss_kib(child)[0]
        except (OSError, KeyError):
            continue
    return total


def lag_max_s(text: str) -> float:
    worst = 0.0
    for line in text.splitlines():
        if line.startswith("proxy_event_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            count = float(line.rsplit(" ", 1)[1])
            total = float(
                next(
                    ln.rsplit(" ", 1)[1]
                    for ln in text.splitlines()
                    if ln.startswith("proxy_event_loop_lag_seconds_count")
                )
            )
            if count < total and le != "+Inf":
                worst = max(worst, float(le))
    return worst


def main() -> None:
    index = hostile.HostileUpstream()
    index.routes["/simple/"] = hostile.ok(root_page(), b"text/html")
    index.routes["/simple/huge/"] = hostile.ok(project_page(), JSON_V1.encode())
    index.start()
    files = FakeUpstream()
    files.files["/hit.bin"] = b"h" * 20_000
    files_server = start_upstream(files)
    try:
        for name, pages in SCENARIOS.items():
            work = workdir("big-pages")
            config = work / "proxy.toml"
            config.write_text(f"""
[storage]
path = "{work / "data"}"
[upstream]
read_timeout = "60s"
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{index.base_url}/simple/"
[[repositories]]
name = "files"
format = "raw"
upstream = "{files.base_url}/"
""")
            proxy, url = start_proxy(config, work, "proxy")
            try:
                client = httpx.Client(timeout=30)
                client.get(url + "/files/hit.bin")
                threads = [
                    threading.Thread(
                        target=lambda p=p, a=a, url=url: httpx.get(
                            url + p, headers={"Accept": a}, timeout=300
                        )
                    )
                    for p, a in pages
                ]
                before, _ = rss_kib(proxy.pid)
                peak = before
                child_peak = 0
                latencies = []
                started = time.monotonic()
                for thread in threads:
                    thread.start()
                while any(t.is_alive() for t in threads):
                    began = time.monotonic()
                    client.get(url + "/files/hit.bin")
                    latencies.append(time.monotonic() - began)
                    peak = max(peak, rss_kib(proxy.pid)[0])
                    child_peak = max(child_peak, children_rss_kib(proxy.pid))
                    time.sleep(0.01)
                elapsed = time.monotonic() - started
                lag = lag_max_s(client.get(url + "/metrics").text)
                q = statistics.quantiles(latencies, n=100) if len(latencies) > 2 else [0] * 99
                print(
                    f"{name:34} {elapsed:5.1f} s  hits p50 {q[49] * 1000:5.1f} ms  "
                    f"p99 {q[98] * 1000:6.1f} ms  max {max(latencies) * 1000:6.1f} ms  "
                    f"loop lag <= {lag * 1000:.0f} ms  RSS {before / 1024:.0f} -> {peak / 1024:.0f} MiB"
                    f" (parse process {child_peak / 1024:.0f} MiB)"
                )
                client.close()
            finally:
                proxy.stop()
                shutil.rmtree(work, ignore_errors=True)
    finally:
        index.stop()
        files_server.stop()


if __name__ == "__main__":
    main()

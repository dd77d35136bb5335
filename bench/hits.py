"""Cache-hit throughput and miss-path memory of one proxy process (issue: foundation).

    .venv/bin/python bench/hits.py [--duration 10] [--connections 32]

Prints: requests/s for a cached 11 KB wheel and MB/s for a cached 100 MiB file (wrk,
32 connections, single process), then the proxy's peak RSS while 20 clients pull one
uncached 1 GiB file. Needs wrk (apt-get install wrk) and curl.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time

import httpx

from bench.common import make_file, rss_kib, start_proxy, start_upstream, workdir, wrk

SMALL = "small/small-1.0-py3-none-any.whl"
LARGE = "large/large-1.0.tar.gz"
HUGE = "huge/huge-1.0.tar.gz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--clients", type=int, default=20, help="clients of the 1 GiB miss")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, files)")
    parser.add_argument(
        "--access-log",
        choices=["on", "off"],
        default="on",
        help="the proxy's access log (on by default, as shipped): compare its cost on hits",
    )
    parser.add_argument("--no-huge", action="store_true", help="skip the 1 GiB miss")
    args = parser.parse_args()

    work = workdir("hits")
    root = work / "upstream"
    make_file(root / SMALL, 11 * 1024)
    make_file(root / LARGE, 100 * 2**20)
    if not args.no_huge:
        make_file(root / HUGE, 2**30)
    upstream, upstream_url = start_upstream(root, work)
    config = work / "proxy.toml"
    config.write_text(f"""
[server]
access_log = {"true" if args.access_log == "on" else "false"}
[storage]
path = "{work / "data"}"
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{upstream_url}/simple/"
""")
    proxy, url = start_proxy(config, work, "proxy")
    try:
        for path in (SMALL, LARGE):
            response = httpx.get(f"{url}/pypi/files/{path}", timeout=120)
            assert response.status_code == 200, response.text
        small = wrk(f"{url}/pypi/files/{SMALL}", args.connections, args.duration)
        large = wrk(f"{url}/pypi/files/{LARGE}", args.connections, args.duration)
        print(
            f"cached 11 KB wheel : {small['requests_s']:>9,.0f} req/s   "
            f"p50 {small.get('p50_ms', 0):.2f} ms  p99 {small.get('p99_ms', 0):.2f} ms"
        )
        print(f"cached 100 MiB file: {large['bytes_s'] / 1e6:>9,.0f} MB/s")
        if args.no_huge:
            return

        httpx.get(f"{url}/pypi/simple/huge/", timeout=60)
        before, _ = rss_kib(proxy.pid)
        started = time.monotonic()
        curls = [
            subprocess.Popen(
                [
                    "curl",
                    "-sS",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code} %{size_download}",
                    f"{url}/pypi/files/{HUGE}",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(args.clients)
        ]
        peak = before
        while any(c.poll() is None for c in curls):
            peak = max(peak, rss_kib(proxy.pid)[0])
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        results = {c.stdout.read() for c in curls if c.stdout}
        print(
            f"1 GiB miss, {args.clients} clients: {elapsed:.1f} s to the last byte, "
            f"results {sorted(results)}"
        )
        print(
            f"  proxy RSS: {before / 1024:.0f} MiB before, {peak / 1024:.0f} MiB peak (sampled every 50 ms)"
        )
    finally:
        proxy.stop()
        upstream.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

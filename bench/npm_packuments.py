"""npm packuments: what rendering them off the loop, and filling in each client's tarball
URLs as they are served, costs (issue 16).

    .venv/bin/python -m bench.npm_packuments [--versions 20000] [--seconds 10]

A proxy process serves an npm repository and a raw one from a local upstream.

1. A cold fetch of a big packument (``--versions`` versions, ~20 MB in full) while a
   client sends a cache hit of a small file every 10 ms: the fetch's time, the hits'
   latencies (p50, p99, max) and the worst event-loop lag the proxy measured (the parse
   and rendering run in a child process; only the rendered bytes come back).
2. wrk on the cached packument, abbreviated form (its base-URL marks filled in per
   request, chunk by chunk), beside wrk on the very same bytes served as a plain raw
   file: requests/s, MB/s, p50 and p99; the difference is the price of the fill-in.
3. The same for a small packument (served from memory) and a small raw file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.common import start_proxy, workdir, wrk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.big_pages import lag_max_s
from tests.upstream import FakeUpstream, start_upstream

ABBREVIATED = "application/vnd.npm.install-v1+json"


def packument(name: str, base: str, versions: int) -> bytes:
    digest = hashlib.sha512(b"x").digest().hex()
    document = {
        "name": name,
        "dist-tags": {"latest": f"1.{versions - 1}.0"},
        "time": {f"1.{i}.0": "2024-01-01T00:00:00.000Z" for i in range(versions)},
        "versions": {
            f"1.{i}.0": {
                "name": name,
                "version": f"1.{i}.0",
                "description": "a package with many versions " * 8,
                "dependencies": {"left-pad": "^1.0.0", "right-pad": "^2.0.0"},
                "scripts": {"test": "node test.js", "build": "tsc -p ."},
                "dist": {
                    "tarball": f"{base}/{name}/-/{name}-1.{i}.0.tgz",
                    "shasum": digest[:40],
                },
            }
            for i in range(versions)
        },
    }
    return json.dumps(document).encode()


def hits_during(url: str, client: httpx.Client, work: threading.Thread) -> list[float]:
    latencies = []
    work.start()
    while work.is_alive():
        began = time.monotonic()
        client.get(url)
        latencies.append(time.monotonic() - began)
        time.sleep(0.01)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--versions", type=int, default=20_000)
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args()
    upstream = FakeUpstream()
    server = start_upstream(upstream)
    work = workdir("npm")
    try:
        big = packument("big", server.url, args.versions)
        small = packument("small", server.url, 3)
        upstream.files["/registry/big"] = big
        upstream.files["/registry/small"] = small
        upstream.content_types["/registry/big"] = "application/json"
        upstream.content_types["/registry/small"] = "application/json"
        upstream.files["/files/hit.bin"] = b"h" * 20_000
        config = work / "proxy.toml"
        config.write_text(f"""
[storage]
path = "{work / "data"}"
[upstream]
read_timeout = "120s"
[[repositories]]
name = "npm"
format = "npm"
upstream = "{server.url}/registry/"
[[repositories]]
name = "files"
format = "raw"
upstream = "{server.url}/files/"
""")
        proxy, url = start_proxy(config, work, "proxy")
        try:
            client = httpx.Client(timeout=300)
            client.get(url + "/files/hit.bin")
            headers = {"Accept": ABBREVIATED}
            fetch = threading.Thread(target=lambda: client.get(url + "/npm/big", headers=headers))
            started = time.monotonic()
            latencies = hits_during(url + "/files/hit.bin", httpx.Client(timeout=30), fetch)
            elapsed = time.monotonic() - started
            served = client.get(url + "/npm/big", headers=headers).content
            lag = lag_max_s(client.get(url + "/metrics").text)
            q = statistics.quantiles(latencies, n=100) if len(latencies) > 2 else [0.0] * 99
            print(
                f"cold fetch of a {len(big) / 2**20:.1f} MB packument ({args.versions} versions, "
                f"{len(served) / 2**20:.1f} MB abbreviated): {elapsed:.1f} s; hits meanwhile "
                f"p50 {q[49] * 1000:.1f} ms p99 {q[98] * 1000:.1f} ms max "
                f"{max(latencies) * 1000:.1f} ms; loop lag <= {lag * 1000:.0f} ms"
            )
            # The same bytes as a plain file, to compare serving with and without fill-in.
            upstream.files["/files/big.json"] = served
            upstream.files["/files/small.json"] = client.get(
                url + "/npm/small", headers=headers
            ).content
            client.get(url + "/files/big.json")
            client.get(url + "/files/small.json")
            for label, npm_path, raw_path in (
                ("big packument", "/npm/big", "/files/big.json"),
                ("small packument", "/npm/small", "/files/small.json"),
            ):
                filled = wrk(url + npm_path, 8, args.seconds, headers=headers)
                plain = wrk(url + raw_path, 8, args.seconds)
                for name, result in (("filled in", filled), ("plain blob", plain)):
                    print(
                        f"{label:16} {name:10} {result['requests_s']:8.0f} req/s "
                        f"{result['bytes_s'] / 2**20:7.1f} MB/s  p50 {result.get('p50_ms', 0):6.1f} ms "
                        f"p99 {result.get('p99_ms', 0):6.1f} ms"
                        + ("  (errors)" if result.get("errors") else "")
                    )
            client.close()
        finally:
            proxy.stop()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

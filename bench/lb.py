"""Cached-file hits through the nginx LB (with its cache) against hits on one replica
directly, side by side in one run of the compose stack (deploy/).

    .venv/bin/python -m bench.lb [--duration 10] [--connections 32] [--image TAG]

Brings up deploy/docker-compose.yml with a fake upstream (as `make deploy-test` does),
warms a 20 KB and a 1 MiB wheel, then runs wrk (apt-get install wrk) against, for each:
  lb        the LB, answered from nginx's cache once the proxy marks files immutable;
  lb-pass   the LB with an Authorization header (nginx never caches those): the LB's
            pass-through to the 3 replicas;
  replica   proxy1 directly (published on 127.0.0.1).
Everything runs on this machine (2 cores here): the figures compare, they do not size.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

from bench.common import wrk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "deploy" / "testing"))

from stack import (
    IMAGE,
    Stack,
    base_images,
    build_image,
    ensure_engine,
    ensure_images,
    file_url,
    log,
    wait_for,
)

# A credential nginx must not cache with; the pypi repository ignores it.
AUTHORIZATION = {"Authorization": "Basic YmVuY2g6YmVuY2g="}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--image", help="use this proxy image instead of building one")
    args = parser.parse_args()

    ensure_engine()
    ensure_images(base_images())
    image = args.image or IMAGE
    if not args.image:
        log(f"image built in {build_image():.1f}s")
    stack = Stack(image=image, prefix="proxybench")
    try:
        started = time.monotonic()
        stack.up()
        client = httpx.Client(timeout=30)
        wait_for(
            "the LB", lambda: client.get(f"{stack.lb}/pypi/simple/dt-beta/").status_code == 200, 60
        )
        log(f"stack {stack.project} up in {time.monotonic() - started:.1f}s")
        rows = []
        for name, size in (("dt-beta", "20 KB"), ("dt-big", "1 MiB")):
            wheel = stack.packages[name]
            client.get(f"{stack.lb}/pypi/simple/{name}/").raise_for_status()
            targets = {
                "lb": (file_url(stack.lb, wheel), {}),
                "lb-pass": (file_url(stack.lb, wheel), AUTHORIZATION),
                "replica": (file_url(stack.proxy1, wheel), {}),
            }
            for target, (url, headers) in targets.items():
                for _ in range(3):  # warm: stored by the proxy, then by nginx
                    response = client.get(url, headers=headers)
                    response.raise_for_status()
                cache_status = response.headers.get("x-cache-status", "-")
                cache_control = response.headers.get("cache-control", "-")
                result = wrk(url, args.connections, args.duration, headers=headers)
                rows.append((size, target, result, cache_status, cache_control))
                log(f"  {size:>6} {target:<8} {result['requests_s']:>9.0f} req/s")
        log("")
        log(f"cached-file hits, wrk -t2 -c{args.connections} -d{args.duration}s, one machine")
        log(
            f"{'file':>6} {'target':<8} {'req/s':>9} {'MB/s':>8} {'p50 ms':>8} {'p99 ms':>8}  X-Cache-Status  Cache-Control"
        )
        for size, target, result, cache_status, cache_control in rows:
            log(
                f"{size:>6} {target:<8} {result['requests_s']:>9.0f} {result['bytes_s'] / 2**20:>8.1f} "
                f"{result.get('p50_ms', 0):>8.2f} {result.get('p99_ms', 0):>8.2f}  {cache_status:<14}  {cache_control}"
                + ("  (errors)" if result.get("errors") else "")
            )
    finally:
        stack.down()


if __name__ == "__main__":
    main()

"""Hits and misses on object storage beside the folder store (docs/architecture.md,
"Object storage"):

- hits with wrk on one 1 MiB file: from the folder store, from a replica's local tier,
  and from the bucket (cold: a replica whose tier holds nothing, so every hit is a GET);
- S3 requests per hit (tier, cold) and per miss (1 MiB, 64 MiB), from the proxy's
  ``proxy_storage_requests_total``;
- a single 1 GiB miss from an unthrottled upstream: client's first to last byte, and
  request to entry recorded (the upload is part of it on the bucket), folder vs bucket.

    .venv/bin/python -m bench.storage [--seconds 10] [--gib 1]

Starts its own SeaweedFS (tests/seaweed.py) and upstream; needs wrk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import httpx

from bench.common import Process, make_file, start_proxy, start_upstream, workdir, wrk
from tests.conftest import s3_storage
from tests.processes import metric_value
from tests.seaweed import SeaweedFS

MB = 10**6
MiB = 2**20


def config(work: Path, name: str, upstream: str, storage: str) -> Path:
    path = work / f"{name}.toml"
    path.write_text(f"""
[database]
url = "sqlite:///{work / name / "catalog.db"}"
[storage]
path = "{work / name / "data"}"
{storage}
[server]
access_log = false
[[repositories]]
name = "files"
format = "raw"
upstream = "{upstream}/files/"
""")
    return path


def requests_made(url: str) -> float:
    return metric_value(
        httpx.get(url + "/metrics", timeout=30).text, "proxy_storage_requests_total"
    )


def hits(label: str, url: str, seconds: int, connections: int) -> None:
    result = wrk(url + "/files/one-mib.bin", connections, seconds, threads=1)
    print(
        f"  {label:<28} c={connections:<3} {result['requests_s']:>7.0f} req/s  {result['bytes_s'] / MB:>7.0f} MB/s  "
        f"p50 {result.get('p50_ms', 0):>6.1f} ms  p99 {result.get('p99_ms', 0):>6.1f} ms"
        + ("  (errors!)" if result.get("errors") else "")
    )


def per_request(url: str, path: str, count: int) -> float:
    before = requests_made(url)
    for _ in range(count):
        response = httpx.get(url + path, timeout=120)
        assert response.status_code == 200
    return (requests_made(url) - before) / count


def one_big_miss(url: str, name: str) -> tuple[float, float]:
    """MB/s from the request to the last byte, and from the request to the entry."""
    started = time.perf_counter()
    with httpx.stream("GET", f"{url}/files/{name}", timeout=600) as response:
        assert response.status_code == 200
        for _ in response.iter_raw(MiB):
            pass
    last = time.perf_counter() - started
    # A request now joins the verified download and is answered once it is recorded.
    assert httpx.head(f"{url}/files/{name}", timeout=600).status_code == 200
    recorded = time.perf_counter() - started
    size = int(response.headers["content-length"])
    return size / last / MB, size / recorded / MB


def run(args: argparse.Namespace) -> None:
    work = workdir("storage")
    seaweed = SeaweedFS().start()
    processes: list[Process] = []
    try:
        files = work / "upstream" / "files"
        make_file(files / "one-mib.bin", MiB)
        for i in range(args.misses):
            make_file(files / f"miss-{i}.bin", MiB)
            make_file(files / f"big-miss-{i}.bin", 64 * MiB)
        make_file(files / "huge-folder.bin", int(args.gib * 2**30))
        make_file(files / "huge-bucket.bin", int(args.gib * 2**30))
        upstream_proc, upstream = start_upstream(work / "upstream", work)
        processes.append(upstream_proc)
        bucket = seaweed.new_bucket()

        def on_bucket(name: str, extra: str = "") -> str:
            return s3_storage(seaweed, bucket, work / name / "local", storage_extra=extra)

        folder_proc, folder = start_proxy(config(work, "folder", upstream, ""), work, "folder")
        tier_proc, tier = start_proxy(
            config(work, "tier", upstream, on_bucket("tier")), work, "tier", env=seaweed.env
        )
        # A tier too small for any copy: every hit is a GET from the bucket.
        cold_proc, cold = start_proxy(
            config(work, "cold", upstream, on_bucket("cold", 'local_cache_max_size = "1"')),
            work, "cold", env=seaweed.env,
        )  # fmt: skip
        processes += [folder_proc, tier_proc, cold_proc]
        for url in (folder, tier):
            assert httpx.get(url + "/files/one-mib.bin", timeout=60).status_code == 200
            httpx.head(url + "/files/one-mib.bin", timeout=60)
        print(
            f"load {os.getloadavg()}; hits of one 1 MiB file, wrk 16 connections, {args.seconds} s:"
        )
        hits("folder store", folder, args.seconds, 16)
        hits("bucket, local tier", tier, args.seconds, 16)
        hits("bucket, cold (a GET each)", cold, args.seconds, 16)
        print("S3 requests per request:")
        print(f"  hit on the local tier: {per_request(tier, '/files/one-mib.bin', 50):.2f}")
        print(f"  cold hit (no local copy): {per_request(cold, '/files/one-mib.bin', 50):.2f}")
        before = requests_made(tier)
        for i in range(args.misses):
            httpx.get(f"{tier}/files/miss-{i}.bin", timeout=120)
            httpx.head(f"{tier}/files/miss-{i}.bin", timeout=120)  # recorded
        small = (requests_made(tier) - before) / args.misses
        before = requests_made(tier)
        for i in range(args.misses):
            httpx.get(f"{tier}/files/big-miss-{i}.bin", timeout=300)
            httpx.head(f"{tier}/files/big-miss-{i}.bin", timeout=300)
        big = (requests_made(tier) - before) / args.misses
        print(f"  miss of 1 MiB: {small:.2f} (one PUT); miss of 64 MiB: {big:.2f} (multipart)")
        print(f"a single {args.gib} GiB miss, upstream unthrottled (load {os.getloadavg()}):")
        for label, url, name in (
            ("folder store", folder, "huge-folder.bin"),
            ("bucket", tier, "huge-bucket.bin"),
        ):
            to_last, to_entry = one_big_miss(url, name)
            print(
                f"  {label:<14} request to last byte {to_last:>6.0f} MB/s; "
                f"request to entry recorded {to_entry:>6.0f} MB/s"
            )
    finally:
        for process in processes:
            process.stop()
        seaweed.destroy()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=int, default=10, help="each wrk run")
    parser.add_argument("--gib", type=float, default=1.0, help="the single big miss")
    parser.add_argument("--misses", type=int, default=5, help="misses counted per size")
    parser.add_argument("--keep", action="store_true")
    run(parser.parse_args())


if __name__ == "__main__":
    main()

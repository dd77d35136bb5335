"""A fleet on one Postgres: one miss for 90 clients, wake-up latency, handover times.

    .venv/bin/python bench/fleet.py [--trials 20]

Starts its own PostgreSQL (initdb/pg_ctl, like the tests) unless PROXY_TEST_POSTGRES_URL
is set, a throttled upstream, and `proxy serve` replicas. Prints:
- upstream GETs and p50/p99 time-to-last-byte for 3 replicas x 30 clients on one 50 MB miss;
- waiter wake-up latency: from the holder's release of the lease (database clock) to the
  waiting replica's client receiving its response headers, with NOTIFY and polling only;
- SIGTERM handover (signal sent -> next holder's claim) and SIGKILL takeover times.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import time
from pathlib import Path

import asyncpg
import httpx

from bench.common import (
    Process,
    make_file,
    percentile,
    start_proxy,
    start_upstream,
    upstream_counts,
    workdir,
)
from tests.pg import PostgresServer, create_database

MB = 10**6


def config(
    work: Path, name: str, db_url: str, upstream: str, ttl: str, notify: bool = True
) -> Path:
    path = work / f"{name}.toml"
    path.write_text(f"""
[database]
url = "{db_url}"
[storage]
path = "{work / "shared"}"
[leases]
ttl = "{ttl}"
poll_interval = "250ms"
notify = {"true" if notify else "false"}
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{upstream}/simple/"
""")
    return path


async def lease(db_url: str, key: str) -> asyncpg.Record | None:
    conn = await asyncpg.connect(db_url)
    try:
        return await conn.fetchrow(
            "SELECT holder, fence, state, extract(epoch FROM acquired_at) AS acquired, "
            "extract(epoch FROM expires_at) AS expires FROM fetch_leases WHERE key = $1",
            key,
        )
    finally:
        await conn.close()


async def wait_lease(
    db_url: str, key: str, predicate: object, timeout_s: float = 60
) -> asyncpg.Record:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = await lease(db_url, key)
        if row is not None and predicate(row):  # type: ignore[operator]
            return row
        await asyncio.sleep(0.002)
    raise RuntimeError(f"lease {key} never reached the expected state")


async def one_miss_for_ninety(urls: list[str], upstream: str, filename: str) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        await client.get(f"{urls[0]}/pypi/simple/big/")
    # curl, not Python: one Python client process would itself be the bottleneck.
    curls = [
        await asyncio.create_subprocess_exec(
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{time_total}",
            f"{u}/pypi/files/big/{filename}",
            stdout=asyncio.subprocess.PIPE,
        )
        for u in urls
        for _ in range(30)
    ]
    outputs = [(await c.communicate())[0].decode().split() for c in curls]
    assert all(status == "200" for status, _ in outputs), outputs
    times = [float(t) for _, t in outputs]
    gets = upstream_counts(upstream).get(f"/packages/big/{filename}", 0)
    print(
        f"3 replicas x 30 clients, one 50 MB miss: {gets} upstream GET(s); time to last byte "
        f"p50 {percentile(times, 50):.2f} s, p99 {percentile(times, 99):.2f} s"
    )


async def wake_up_latency(
    db_url: str, holder: str, waiter: str, work: Path, trials: int, label: str
) -> None:
    latencies = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(trials):
            name = f"wake{i}x{label.split()[0].lower()}"
            make_file(work / "upstream" / name / f"{name}-1.0.tar.gz", 4 * MB)
            await client.get(f"{holder}/pypi/simple/{name}/")
            key = f"pypi/files/{name}/{name}-1.0.tar.gz"
            holding = asyncio.ensure_future(
                client.get(f"{holder}/pypi/files/{name}/{name}-1.0.tar.gz")
            )
            await wait_lease(db_url, key, lambda r: r["state"] == "fetching")
            async with client.stream(
                "GET", f"{waiter}/pypi/files/{name}/{name}-1.0.tar.gz"
            ) as response:
                answered = time.time()
                assert response.status_code == 200
            await holding
            row = await lease(db_url, key)
            assert row is not None and row["state"] == "done"
            latencies.append((answered - float(row["expires"])) * 1000)
    print(
        f"wake-up latency ({label}): p50 {statistics.median(latencies):.1f} ms, "
        f"p99 {percentile(latencies, 99):.1f} ms over {trials} misses"
    )


async def handover(
    db_url: str, cfg: Path, work: Path, sig: signal.Signals, trials: int
) -> list[float]:
    times = []
    for i in range(trials):
        name = f"handover{sig.name.lower()}{i}"
        make_file(work / "upstream" / name / f"{name}-1.0.tar.gz", 40 * MB)
        holder_proc, holder = start_proxy(cfg, work, f"holder-{name}")
        waiter_proc, waiter = start_proxy(cfg, work, f"waiter-{name}")
        try:
            async with httpx.AsyncClient(timeout=300) as client:
                await client.get(f"{holder}/pypi/simple/{name}/")
                key = f"pypi/files/{name}/{name}-1.0.tar.gz"
                holding = asyncio.ensure_future(
                    client.get(f"{holder}/pypi/files/{name}/{name}-1.0.tar.gz")
                )
                first = await wait_lease(db_url, key, lambda r: r["state"] == "fetching")
                waiting = asyncio.ensure_future(
                    client.get(f"{waiter}/pypi/files/{name}/{name}-1.0.tar.gz")
                )
                await asyncio.sleep(1.0)
                sent = time.time()
                os.kill(holder_proc.pid, sig)
                second = await wait_lease(
                    db_url, key, lambda r, f=first["fence"]: r["fence"] > f, timeout_s=120
                )
                times.append((float(second["acquired"]) - sent) * 1000)
                waiting.cancel()
                holding.cancel()
        finally:
            holder_proc.stop()
            waiter_proc.stop()
    return times


async def run(args: argparse.Namespace) -> None:
    work = workdir("fleet")
    server = None
    admin_url = os.environ.get("PROXY_TEST_POSTGRES_URL")
    if not admin_url:
        server = PostgresServer().init().start()
        admin_url = server.admin_url
    processes: list[Process] = []
    try:
        make_file(work / "upstream/big/big-1.0.tar.gz", 50 * MB)
        upstream_proc, upstream = start_upstream(
            work / "upstream", work, rate_mbps=args.upstream_mbps
        )
        processes.append(upstream_proc)
        db_url = await asyncio.to_thread(create_database, admin_url)
        cfg = config(work, "fleet", db_url, upstream, "15s")
        urls = []
        for i in range(3):
            proc, url = start_proxy(cfg, work, f"replica-{i}")
            processes.append(proc)
            urls.append(url)
        await one_miss_for_ninety(urls, upstream, "big-1.0.tar.gz")
        await wake_up_latency(db_url, urls[0], urls[1], work, args.trials, "NOTIFY")
        deaf_proc, deaf = start_proxy(
            config(work, "deaf", db_url, upstream, "15s", notify=False), work, "deaf"
        )
        processes.append(deaf_proc)
        await wake_up_latency(db_url, urls[0], deaf, work, args.trials, "polling only, 250ms")
        for proc in processes[1:]:
            proc.stop()

        term = await handover(
            db_url, config(work, "term", db_url, upstream, "30s"), work, signal.SIGTERM, 3
        )
        print(f"SIGTERM handover (TTL 30s): {', '.join(f'{t:.0f}' for t in term)} ms")
        kill = await handover(
            db_url, config(work, "kill", db_url, upstream, "5s"), work, signal.SIGKILL, 2
        )
        print(f"SIGKILL takeover (TTL 5s): {', '.join(f'{t:.0f}' for t in kill)} ms")
    finally:
        for proc in processes:
            proc.stop()
        if server is not None:
            server.destroy()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--upstream-mbps", type=float, default=20.0, help="upstream throttle, MB/s")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, files)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

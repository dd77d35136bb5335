"""A fleet on one Postgres: one miss for 90 clients, a single fast miss, wake-up latency,
handover times.

    .venv/bin/python -m bench.fleet [--trials 20] [--single-trials 3] [--storage s3]

Starts its own PostgreSQL (initdb/pg_ctl, like the tests) unless PROXY_TEST_POSTGRES_URL
is set, a throttled upstream, and `proxy serve` replicas: on one shared folder, or
(``--storage s3``) on a bucket of a SeaweedFS of its own with a local folder per replica
(streaming across replicas then goes through the holders' relays). Prints:
- upstream GETs for 3 replicas x 30 clients on one 50 MB miss (upstream at 20 MB/s),
  time to first and to last byte per role (clients of the holder / of the waiting
  replicas), how long after the holder's first byte the waiters' first bytes came, and
  each replica's peak RSS;
- a single 1 GiB miss from an unthrottled upstream: MB/s from first to last byte, as
  the VM's memory comes, then with --warm-gib of memory touched first (see
  bench.common.warm_memory);
- a waiter joining a running download: its first byte after its request, and its last
  byte after the holder's release of the lease (database clock), with NOTIFY and
  polling only;
- SIGTERM handover (signal sent -> next holder's claim) and SIGKILL takeover times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    rss_kib,
    start_proxy,
    start_upstream,
    upstream_counts,
    warm_memory,
    workdir,
)
from tests.pg import PostgresServer, create_database

MB = 10**6
GiB = 2**30


STORAGE = {"keys": "", "env": {}}  # set by run(): the [storage] table and the proxies' env


def config(
    work: Path, name: str, db_url: str, upstream: str, ttl: str, notify: bool = True
) -> Path:
    path = work / f"{name}.toml"
    path.write_text(f"""
[database]
url = "{db_url}"
[storage]
{STORAGE["keys"]}
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


def curl(url: str) -> list[str]:
    # Status, then seconds from curl's start to the first body byte and to the last.
    return [
        "curl", "-sS", "-o", "/dev/null", "-w",
        "%{http_code} %{time_starttransfer} %{time_total}", url,
    ]  # fmt: skip


async def timed_clients(urls: list[str]) -> list[tuple[str, float, float, float]]:
    """(url, launch, first byte, last byte) per client, as seconds since the epoch."""
    launched = []
    for url in urls:
        at = time.time()
        launched.append(
            (
                url,
                at,
                await asyncio.create_subprocess_exec(*curl(url), stdout=asyncio.subprocess.PIPE),
            )
        )
    results = []
    for url, at, process in launched:
        status, first, last = (await process.communicate())[0].decode().split()
        assert status == "200", (url, status)
        results.append((url, at, at + float(first), at + float(last)))
    return results


async def sample_rss(pids: list[int], peaks: dict[int, int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for pid in pids:
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                peaks[pid] = max(peaks.get(pid, 0), rss_kib(pid)[0])
        await asyncio.sleep(0.05)


async def waits(url: str) -> float:
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"{url}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("proxy_fetch_lease_waits_total{")
    )


async def one_miss_for_ninety(
    replicas: list[tuple[Process, str]], upstream: str, filename: str
) -> None:
    urls = [url for _, url in replicas]
    async with httpx.AsyncClient(timeout=300) as client:
        await client.get(f"{urls[0]}/pypi/simple/big/")
    before = {url: await waits(url) for url in urls}
    peaks: dict[int, int] = {}
    stop = asyncio.Event()
    pids = [process.pid for process, _ in replicas]

    async def clients() -> list[tuple[str, float, float, float]]:
        # curl, not Python: one Python client process would itself be the bottleneck.
        try:
            return await timed_clients(
                [f"{u}/pypi/files/big/{filename}" for _ in range(30) for u in urls]
            )
        finally:
            stop.set()

    started = time.time()
    results, _ = await asyncio.gather(clients(), sample_rss(pids, peaks, stop))
    gets = upstream_counts(upstream).get(f"/packages/big/{filename}", 0)
    # The holder is the replica whose requests never waited on a lease.
    after = {url: await waits(url) for url in urls}
    holder = next(u for u in urls if after[u] == before[u])
    first_byte = min(first for url, _, first, _ in results if url.startswith(holder))
    print(
        f"3 replicas x 30 clients, one 50 MB miss: {gets} upstream GET(s); "
        "from the clients' start, p50/p99:"
    )
    for role, mine in (("holder", True), ("waiter", False)):
        rows = [row for row in results if row[0].startswith(holder) == mine]
        ttfb = [first - started for _, _, first, _ in rows]
        ttlb = [last - started for _, _, _, last in rows]
        # What the proxy adds: from the later of the client's launch and the holder's
        # first byte (launching 90 curls takes a while) to this client's first byte.
        behind = [(first - max(at, first_byte)) * 1000 for _, at, first, _ in rows]
        print(
            f"  {role}s ({len(rows)} clients): first byte {percentile(ttfb, 50):.2f}/"
            f"{percentile(ttfb, 99):.2f} s, last byte {percentile(ttlb, 50):.2f}/"
            f"{percentile(ttlb, 99):.2f} s; first byte after the holder's first (or "
            f"the client's start) {percentile(behind, 50):.0f}/{percentile(behind, 99):.0f} ms"
        )
    rss = ", ".join(f"{kib / 1024:.0f}" for kib in peaks.values())
    print(f"  peak RSS per replica (30 clients each): {rss} MiB")


async def single_miss(url: str, work: Path, trials: int, warm_gib: int) -> None:
    """One client, one 1 GiB miss, the upstream not throttled: the miss path's speed,
    into page cache as the VM gives it, then into memory touched just before."""
    async with httpx.AsyncClient(timeout=300) as client:
        for warm in (0, warm_gib) if warm_gib else (0,):
            rates = []
            for i in range(trials):
                name = f"solo{warm}x{i}"
                make_file(work / "fast" / name / f"{name}-1.0.tar.gz", GiB)
                await client.get(f"{url}/pypi/simple/{name}/")
                if warm:
                    warm_memory(warm * GiB)
                [(_, _, first, last)] = await timed_clients(
                    [f"{url}/pypi/files/{name}/{name}-1.0.tar.gz"]
                )
                rates.append(GiB / (last - first + 1e-9) / MB)
                (work / "fast" / name / f"{name}-1.0.tar.gz").unlink()
            memory = f"{warm} GiB of memory touched first" if warm else "memory as it comes"
            print(
                f"single 1 GiB miss, one client, upstream unthrottled, {memory}: "
                f"{', '.join(f'{r:.0f}' for r in rates)} MB/s (first to last byte)"
            )


async def wake_up_latency(
    db_url: str, holder: str, waiter: str, work: Path, trials: int, label: str
) -> None:
    """A waiter joins a download in progress: how soon its client has a first byte, and
    how long after the holder's release (database clock) it has the last byte, which
    waits for the lease's outcome."""
    first_bytes, last_bytes = [], []
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
            asked = time.time()
            first = 0.0
            async with client.stream(
                "GET", f"{waiter}/pypi/files/{name}/{name}-1.0.tar.gz"
            ) as response:
                assert response.status_code == 200
                async for _ in response.aiter_raw():
                    first = first or time.time()
            last = time.time()
            await holding
            row = await lease(db_url, key)
            assert row is not None and row["state"] == "done"
            first_bytes.append((first - asked) * 1000)
            last_bytes.append((last - float(row["expires"])) * 1000)
    print(
        f"a waiter joining a running download ({label}): first byte after "
        f"p50 {statistics.median(first_bytes):.0f} / p99 {percentile(first_bytes, 99):.0f} ms; "
        f"last byte after the holder's release p50 {statistics.median(last_bytes):.1f} / "
        f"p99 {percentile(last_bytes, 99):.1f} ms ({trials} misses)"
    )


async def handover(
    db_url: str, cfg: Path, work: Path, sig: signal.Signals, trials: int
) -> list[float]:
    times = []
    for i in range(trials):
        name = f"handover{sig.name.lower()}{i}"
        make_file(work / "upstream" / name / f"{name}-1.0.tar.gz", 40 * MB)
        holder_proc, holder = proxy(cfg, work, f"holder-{name}")
        waiter_proc, waiter = proxy(cfg, work, f"waiter-{name}")
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


def proxy(cfg: Path, work: Path, name: str) -> tuple[Process, str]:
    return start_proxy(cfg, work, name, env=STORAGE["env"])  # type: ignore[arg-type]


async def run(args: argparse.Namespace) -> None:
    work = workdir("fleet")
    seaweed = None
    if args.storage == "s3":
        from tests.conftest import s3_storage
        from tests.seaweed import SeaweedFS

        seaweed = SeaweedFS().start()
        bucket = seaweed.new_bucket()
        keys = s3_storage(seaweed, bucket, Path(f"{work}/local-${{REPLICA_NAME}}"))
        STORAGE["keys"] = f'path = "{work / "data"}"\n{keys}'
        STORAGE["env"] = seaweed.env
    else:
        STORAGE["keys"] = f'path = "{work / "shared"}"'
    print(f"storage: {args.storage}")
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
        replicas = [proxy(cfg, work, f"replica-{i}") for i in range(3)]
        processes += [proc for proc, _ in replicas]
        urls = [url for _, url in replicas]
        await one_miss_for_ninety(replicas, upstream, "big-1.0.tar.gz")
        fast_proc, fast = start_upstream(work / "fast", work)
        processes.append(fast_proc)
        solo_proc, solo = proxy(config(work, "solo", db_url, fast, "15s"), work, "solo")
        processes.append(solo_proc)
        await single_miss(solo, work, args.single_trials, args.warm_gib)
        await wake_up_latency(db_url, urls[0], urls[1], work, args.trials, "NOTIFY")
        deaf_proc, deaf = proxy(
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
        if seaweed is not None:
            seaweed.destroy()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--single-trials", type=int, default=3, help="1 GiB single misses")
    parser.add_argument(
        "--warm-gib", type=int, default=8, help="memory to touch before warm single misses"
    )
    parser.add_argument("--upstream-mbps", type=float, default=20.0, help="upstream throttle, MB/s")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, files)")
    parser.add_argument(
        "--storage", choices=["folder", "s3"], default="folder", help="where the blobs live"
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

"""A soak with faults: three replicas on Postgres under a pip-like load while replicas
are killed, paused and restarted, Postgres restarts, the upstream fails, hangs and
trickles, and the storage disk fills up; every answer is checked as it comes.

    .venv/bin/python -m bench.soak [--duration 20m] [--clients 16] [--seed 1]

The load: ``--clients`` clients, each in a loop, ask a replica (chosen at random, as a
load balancer without affinity does; on a refused connection another one, as nginx's
``proxy_next_upstream error``) for a project's index page (pip's Accept header), pick a
file from it and download it. Projects and files are picked with skewed popularity
(Zipf), so hot files are shared by many clients and cold ones miss. Pages expire every
15 s, so revalidations and stale answers happen too.

Checked continuously: every 200 body against the file's sha256 (a wrong body is the one
failure that must never happen); statuses; how long each request took. At the end
(faults off, load stopped, a short settle): leases still held, job runs left
`running`, temp files left in the storage, descriptors each replica holds against its
start, upstream downloads per file (at most 1 plus the kills, pauses and database
restarts during its downloads; requests made once the disk was full are not counted:
their bodies are refused unread), tracebacks in the logs, RSS per replica over time. The
exit status is 1 if anything that must be zero is not.

The storage is a tmpfs of its own when the soak runs as root (so the disk-full fault
is real); otherwise a plain folder, and that fault is skipped and said so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import asyncpg
import httpx

from bench.common import ROOT, free_port, wait_http, workdir
from proxy.units import format_duration, human_size, parse_duration

sys.path.insert(0, str(ROOT))
from tests.pg import PostgresServer, create_database
from tests.processes import ProxyProcess

PIP_ACCEPT = (
    "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html; q=0.1, "
    "text/html; q=0.01"
)
JSON_V1 = "application/vnd.pypi.simple.v1+json"
REPLICAS = 3
SLOW_REQUEST_S = 30.0  # a client waiting longer than this is counted as waiting too long
CLIENT_TIMEOUT_S = 120.0  # bounds every request of the load (no loop waits forever)
FAULT_HOLD_S = 8.0
RESTART_DELAY_S = 3.0
PAUSE_S = 7.0  # longer than the lease TTL: a paused holder loses its leases
SETTLE_S = 12.0
RSS_EVERY_S = 5.0
FD_GROWTH_ALLOWED = 40  # descriptors a replica may hold beyond its start (pools, caches)
# Faults after which a file may be downloaded again: the download was cut.
# (A hung upstream's late answer to a request we gave up on is logged as a download too.)
CUTTING_FAULTS = {"sigkill", "sigterm", "pause", "postgres", "disk_full", "upstream_hang"}


# -- the files ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakFile:
    project: str
    name: str
    size: int
    sha256: str


def make_files(root: Path, projects: int, rng: random.Random) -> dict[str, list[SoakFile]]:
    """Projects of 3-8 files: mostly a few KB to a few hundred KB, some MBs, a few
    tens of MB (the downloads a kill is likely to cut)."""
    catalog: dict[str, list[SoakFile]] = {}
    for p in range(projects):
        project = f"soak{p:03d}"
        folder = root / project
        folder.mkdir(parents=True, exist_ok=True)
        files = []
        for v in range(rng.randint(3, 8)):
            roll = rng.random()
            if roll < 0.80:
                size = int(rng.lognormvariate(10.5, 1.2)) + 500  # ~40 KB median
            elif roll < 0.97:
                size = rng.randint(1, 6) * 1024 * 1024
            else:
                size = rng.randint(15, 30) * 1024 * 1024
            name = f"{project}-1.{v}.tar.gz"
            data = rng.randbytes(size)
            (folder / name).write_bytes(data)
            files.append(SoakFile(project, name, size, hashlib.sha256(data).hexdigest()))
        catalog[project] = files
    return catalog


def zipf_pick(items: list[Any], rng: random.Random, s: float = 1.1) -> Any:
    weights = [1 / (rank + 1) ** s for rank in range(len(items))]
    return rng.choices(items, weights)[0]


# -- the fleet ---------------------------------------------------------------------------


@dataclass
class Fleet:
    replicas: list[ProxyProcess]
    postgres: PostgresServer
    database_url: str
    upstream_url: str
    data: Path
    tmpfs: bool
    down: set[int] = field(default_factory=set)  # replicas stopped by a fault right now
    # From the moment the filler had taken the last byte to its removal (disk_full).
    full_windows: list[tuple[float, float]] = field(default_factory=list)
    start_fds: dict[int, int] = field(default_factory=dict)

    def live(self) -> list[int]:
        return [i for i in range(len(self.replicas)) if i not in self.down]


def config_text(data: Path, database_url: str, upstream_url: str) -> str:
    return f"""
[database]
url = "{database_url}"
[storage]
path = "{data}"
min_free = "1MB"
[upstream]
connect_timeout = "1s"
read_timeout = "5s"
transfer_timeout = "120s"
min_rate = "4KiB/s"
min_rate_window = "5s"
retries = 1
[leases]
ttl = "5s"
poll_interval = "250ms"
[jobs]
reclaim_interval = "10s"
evict_interval = "10s"
evict_grace = "5s"
[[repositories]]
name = "pypi"
format = "pypi"
upstream = "{upstream_url}/simple/"
metadata_ttl = "15s"
negative_ttl = "10s"
"""


def mount_tmpfs(path: Path, size_bytes: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
    )
    return done.returncode == 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


# -- the load ----------------------------------------------------------------------------


@dataclass
class Results:
    started: float
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    wrong_bodies: list[str] = field(default_factory=list)
    cut_bodies: int = 0
    connection_errors: int = 0
    slow: list[tuple[str, float]] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)
    bytes_checked: int = 0
    bodies_checked: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


async def fetch_on_fleet(
    client: httpx.AsyncClient,
    fleet: Fleet,
    path: str,
    headers: dict[str, str],
    rng: random.Random,
    results: Results,
) -> httpx.Response | None:
    """GET ``path`` from a random live replica; on a refused connection, from another
    (at most three tries, like the shipped nginx). The response is fully read."""
    tried: set[int] = set()
    for _ in range(3):
        candidates = [i for i in fleet.live() if i not in tried] or fleet.live() or [0]
        index = rng.choice(candidates)
        tried.add(index)
        url = fleet.replicas[index].url + path
        try:
            return await client.get(url, headers=headers)
        except httpx.ConnectError:
            results.connection_errors += 1
            continue
    return None


async def client_loop(
    number: int,
    fleet: Fleet,
    catalog: dict[str, list[SoakFile]],
    results: Results,
    stop: asyncio.Event,
    seed: int,
) -> None:
    rng = random.Random(seed * 1000 + number)
    projects = sorted(catalog)
    by_name = {f.name: f for files in catalog.values() for f in files}
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S, connect=2.0)
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=True) as client:
        while not stop.is_set():
            project = zipf_pick(projects, rng)
            page_path = f"/pypi/simple/{project}/"
            page = await _timed(
                "page",
                results,
                fetch_on_fleet(client, fleet, page_path, {"Accept": PIP_ACCEPT}, rng, results),
            )
            if page is None or page.status_code != 200:
                await asyncio.sleep(0.2)
                continue
            try:
                listed = _files_of(page, page_path)
            except ValueError as exc:
                results.wrong_bodies.append(f"{page_path}: unreadable page: {exc}")
                continue
            names = sorted(listed)
            if not names:
                results.wrong_bodies.append(f"{page_path}: lists no file")
                continue
            name = zipf_pick(names, rng)
            expected = by_name[name]
            if listed[name][1] != expected.sha256:
                results.wrong_bodies.append(f"{page_path}: lists {name} with a wrong sha256")
            file_path = listed[name][0]
            try:
                response = await _timed(
                    "file", results, fetch_on_fleet(client, fleet, file_path, {}, rng, results)
                )
            except httpx.HTTPError:
                results.cut_bodies += 1  # cut short: an honest failure, the client retries
                continue
            if response is None or response.status_code != 200:
                continue
            results.bodies_checked += 1
            results.bytes_checked += len(response.content)
            if hashlib.sha256(response.content).hexdigest() != expected.sha256:
                results.wrong_bodies.append(
                    f"{file_path}: {len(response.content)} bytes, sha256 differs "
                    f"(expected {expected.size} bytes)"
                )


async def _timed(
    kind: str, results: Results, request: Awaitable[httpx.Response | None]
) -> httpx.Response | None:
    started = time.monotonic()
    try:
        response = await request
    except httpx.HTTPError:
        results.statuses[(kind, 0)] += 1
        raise
    elapsed = time.monotonic() - started
    results.latencies[kind].append(elapsed)
    if response is None:
        results.statuses[(kind, -1)] += 1  # no replica reachable
        return None
    results.statuses[(kind, response.status_code)] += 1
    if elapsed > SLOW_REQUEST_S:
        results.slow.append((str(response.url), elapsed))
    if response.status_code >= 500 and response.status_code not in (502, 503, 504):
        results.server_errors.append(
            f"{response.status_code} {response.url}: {response.text[:200]}"
        )
    return response


def _files_of(page: httpx.Response, page_path: str) -> dict[str, tuple[str, str]]:
    """filename -> (the path to download it, its listed sha256)."""
    base = "http://proxy" + page_path
    found: dict[str, tuple[str, str]] = {}
    if page.headers.get("content-type", "").startswith(JSON_V1):
        for f in page.json()["files"]:
            url = urljoin(base, f["url"]).removeprefix("http://proxy")
            found[f["filename"]] = (url.split("#")[0], f["hashes"]["sha256"])
        return found
    import re

    for href, name in re.findall(r'<a href="([^"]+)"[^>]*>([^<]+)</a>', page.text):
        url, _, fragment = href.partition("#")
        found[name] = (urljoin(base, url).removeprefix("http://proxy"), fragment.split("=")[-1])
    return found


# -- the faults --------------------------------------------------------------------------


@dataclass
class FaultRecord:
    kind: str
    start: float
    end: float
    detail: str


async def run_faults(
    fleet: Fleet, stop: asyncio.Event, interval_s: float, rng: random.Random, log: list[FaultRecord]
) -> None:
    kinds = ["sigkill", "upstream_fail", "disk_full" if fleet.tmpfs else "upstream_fail"]
    kinds += ["sigterm", "upstream_hang", "pause", "postgres", "upstream_trickle"]
    order = kinds[:]
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        if stop.is_set():
            return
        if not order:
            order = kinds[:]
            rng.shuffle(order)
        kind = order.pop(0)
        started = time.time()
        detail = await FAULTS[kind](fleet, rng)
        log.append(FaultRecord(kind, started, time.time(), detail))
        print(f"  [{time.strftime('%H:%M:%S')}] fault {kind}: {detail}", flush=True)


async def _restart(fleet: Fleet, index: int) -> None:
    replica = fleet.replicas[index]
    await asyncio.sleep(RESTART_DELAY_S)
    await asyncio.to_thread(replica.start().wait_ready)
    fleet.start_fds[index] = fd_count(replica.pid)  # a new process: a new baseline
    fleet.down.discard(index)


def _victim(fleet: Fleet, rng: random.Random) -> int:
    return rng.choice(fleet.live())


async def fault_sigkill(fleet: Fleet, rng: random.Random) -> str:
    index = _victim(fleet, rng)
    fleet.down.add(index)
    fleet.replicas[index].signal(signal.SIGKILL)
    await asyncio.to_thread(fleet.replicas[index].wait)
    await _restart(fleet, index)
    return f"replica {index} killed (SIGKILL) and restarted"


async def fault_sigterm(fleet: Fleet, rng: random.Random) -> str:
    index = _victim(fleet, rng)
    fleet.down.add(index)
    began = time.monotonic()
    await asyncio.to_thread(fleet.replicas[index].stop)
    took = time.monotonic() - began
    await _restart(fleet, index)
    return f"replica {index} stopped (SIGTERM, {took:.1f} s) and restarted"


async def fault_pause(fleet: Fleet, rng: random.Random) -> str:
    index = _victim(fleet, rng)
    fleet.replicas[index].signal(signal.SIGSTOP)
    await asyncio.sleep(PAUSE_S)
    fleet.replicas[index].signal(signal.SIGCONT)
    return f"replica {index} paused {PAUSE_S:.0f} s (SIGSTOP/SIGCONT)"


async def fault_postgres(fleet: Fleet, rng: random.Random) -> str:
    await asyncio.to_thread(fleet.postgres.stop, "fast")
    await asyncio.sleep(RESTART_DELAY_S)
    await asyncio.to_thread(fleet.postgres.start)
    return f"Postgres restarted ({RESTART_DELAY_S:.0f} s down)"


def _upstream_mode(mode: str) -> Callable[[Fleet, random.Random], Awaitable[str]]:
    async def fault(fleet: Fleet, rng: random.Random) -> str:
        async with httpx.AsyncClient() as client:
            await client.post(f"{fleet.upstream_url}/_fault?mode={mode}")
            await asyncio.sleep(FAULT_HOLD_S)
            await client.post(f"{fleet.upstream_url}/_fault?mode=none")
        return f"upstream {mode} for {FAULT_HOLD_S:.0f} s"

    return fault


async def fault_disk_full(fleet: Fleet, rng: random.Random) -> str:
    filler = fleet.data / "filler.bin"

    def fill() -> int:
        written = 0
        block = b"\0" * (1024 * 1024)
        with filler.open("wb") as fh, contextlib.suppress(OSError):
            while True:
                fh.write(block)
                fh.flush()
                written += len(block)
        return written

    written = await asyncio.to_thread(fill)
    full_from = time.time()
    await asyncio.sleep(FAULT_HOLD_S)
    filler.unlink(missing_ok=True)
    fleet.full_windows.append((full_from, time.time()))
    return f"storage filled ({human_size(written)} of filler) for {FAULT_HOLD_S:.0f} s"


FAULTS: dict[str, Callable[[Fleet, random.Random], Awaitable[str]]] = {
    "sigkill": fault_sigkill,
    "sigterm": fault_sigterm,
    "pause": fault_pause,
    "postgres": fault_postgres,
    "upstream_fail": _upstream_mode("fail"),
    "upstream_hang": _upstream_mode("hang"),
    "upstream_trickle": _upstream_mode("trickle"),
    "disk_full": fault_disk_full,
}


async def sample_rss(fleet: Fleet, stop: asyncio.Event, series: dict[int, list[float]]) -> None:
    while not stop.is_set():
        for index, replica in enumerate(fleet.replicas):
            if index in fleet.down:
                continue
            with contextlib.suppress(OSError, AssertionError, ValueError):
                series[index].append(replica.rss_mib())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RSS_EVERY_S)


# -- the checks at the end ------------------------------------------------------------------


async def database_leftovers(url: str) -> tuple[int, list[str]]:
    conn = await asyncpg.connect(url)
    try:
        held = await conn.fetchval(
            "SELECT count(*) FROM fetch_leases "
            "WHERE state = 'fetching' AND expires_at > clock_timestamp()"
        )
        stuck = await conn.fetch(
            "SELECT name FROM job_runs WHERE outcome = 'running' "
            "AND started_at < clock_timestamp() - interval '2 minutes'"
        )
        return int(held), [row["name"] for row in stuck]
    finally:
        await conn.close()


def downloads_per_file(
    upstream_log: list[list[Any]],
    faults: list[FaultRecord],
    full: list[tuple[float, float]],
    origin: float,
) -> tuple[Counter[str], list[str]]:
    """Upstream downloads (200s) per file, and the files downloaded more often than 1
    plus the cutting faults that fell within the span of their downloads, each with its
    timeline (seconds from ``origin``: every download's bytes sent, every fault).

    Requests made while the disk was full (``full``: from the filler's last byte to its
    removal) do not count: under ``storage.min_free`` the proxy asks the upstream (a 404
    must stay a 404) and refuses the body unread, which this upstream cannot tell from a
    download (its log entry is made with the head). Those made while it filled count."""
    downloads: dict[str, list[list[Any]]] = defaultdict(list)
    for entry in upstream_log:
        if any(start <= entry[0] <= end for start, end in full):
            continue
        if entry[1].startswith("/packages/") and entry[2] == 200:
            downloads[entry[1]].append(entry)
    counts = Counter({path: len(entries) for path, entries in downloads.items()})
    too_many = []
    for path, entries in downloads.items():
        first, last = min(e[0] for e in entries), max(e[0] for e in entries)
        cuts = sum(
            1 for f in faults if f.kind in CUTTING_FAULTS and f.start <= last and f.end >= first
        )
        if len(entries) > 1 + cuts:
            fetched = ", ".join(
                f"{at - origin:.1f} s ({sent} B{'' if complete else ', cut'})"
                for at, _path, _status, sent, complete in entries
            )
            timeline = ", ".join(
                f"{f.kind} {f.start - origin:.1f}-{f.end - origin:.1f} s" for f in faults
            )
            too_many.append(
                f"{path}: {len(entries)} downloads, {cuts} cutting faults meanwhile; "
                f"downloads at {fetched}; faults: {timeline}"
            )
    return counts, too_many


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


# -- main -------------------------------------------------------------------------------------


async def soak(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    work = workdir("soak")
    print(f"soak: {format_duration(args.duration_s)}, {args.clients} clients, work in {work}")
    catalog = await asyncio.to_thread(make_files, work / "upstream", args.projects, rng)
    total = sum(f.size for files in catalog.values() for f in files)
    count = sum(len(files) for files in catalog.values())
    print(f"  {count} files in {len(catalog)} projects, {human_size(total)}")

    up_port = free_port()
    upstream = subprocess.Popen(  # noqa: ASYNC220 (starting it does not wait for it)
        [sys.executable, str(ROOT / "bench/soak_upstream.py"), "--root", str(work / "upstream"),
         "--port", str(up_port)],
        stdout=(work / "upstream.log").open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    upstream_url = f"http://127.0.0.1:{up_port}"
    postgres = PostgresServer().init().start()
    data = work / "data"
    tmpfs = mount_tmpfs(data, max(3 * total, 256 * 1024 * 1024))
    if not tmpfs:
        print("  storage: a plain folder (not root, or no tmpfs): the disk-full fault is skipped")
    fleet: Fleet | None = None
    try:
        await asyncio.to_thread(wait_http, upstream_url + "/_log")
        database_url = await asyncio.to_thread(create_database, postgres.admin_url)
        config = work / "soak.toml"
        config.write_text(config_text(data, database_url, upstream_url))
        replicas = [ProxyProcess(config, work, f"replica-{i}") for i in range(REPLICAS)]
        for replica in replicas:
            replica.start()
        for replica in replicas:
            await asyncio.to_thread(replica.wait_ready)
        fleet = Fleet(replicas, postgres, database_url, upstream_url, data, tmpfs)
        fleet.start_fds = {i: fd_count(r.pid) for i, r in enumerate(replicas)}

        results = Results(started=time.time())
        faults: list[FaultRecord] = []
        rss: dict[int, list[float]] = defaultdict(list)
        stop = asyncio.Event()
        interval_s = max(3.0, min(30.0, args.duration_s / 16))  # the gap between faults
        tasks = [
            asyncio.create_task(client_loop(n, fleet, catalog, results, stop, args.seed))
            for n in range(args.clients)
        ]
        fault_task = asyncio.create_task(run_faults(fleet, stop, interval_s, rng, faults))
        rss_task = asyncio.create_task(sample_rss(fleet, stop, rss))
        await asyncio.sleep(args.duration_s)
        stop.set()
        await fault_task  # the fault under way ends (replica back, upstream healthy)
        await asyncio.gather(*tasks, return_exceptions=True)
        await rss_task
        print(f"  load stopped; settling {SETTLE_S:.0f} s")
        await asyncio.sleep(SETTLE_S)

        held, stuck = await database_leftovers(database_url)
        fd_growth = {
            i: fd_count(r.pid) - fleet.start_fds.get(i, 0) for i, r in enumerate(fleet.replicas)
        }
        async with httpx.AsyncClient() as client:
            log_text = (await client.get(upstream_url + "/_log")).text
        upstream_log = [json.loads(line) for line in log_text.splitlines() if line]
        downloads, too_many = downloads_per_file(
            upstream_log, faults, fleet.full_windows, results.started
        )
        for replica in fleet.replicas:
            await asyncio.to_thread(replica.stop)
        temp_files = sorted(p.name for p in (data / "tmp").glob("*") if p.is_file())
        tracebacks = sum(r.log().count("Traceback") for r in fleet.replicas)
        return report(
            results, faults, rss, held, stuck, fd_growth, downloads, too_many, temp_files,
            tracebacks, time.time() - results.started,
        )  # fmt: skip
    finally:
        if fleet is not None:
            for replica in fleet.replicas:
                with contextlib.suppress(Exception):
                    replica.signal(signal.SIGCONT)
                    replica.stop()
        upstream.terminate()
        postgres.destroy()
        if tmpfs:
            await asyncio.to_thread(subprocess.run, ["umount", "-l", str(data)], check=False)


def report(
    results: Results,
    faults: list[FaultRecord],
    rss: dict[int, list[float]],
    held: int,
    stuck: list[str],
    fd_growth: dict[int, int],
    downloads: Counter[str],
    too_many: list[str],
    temp_files: list[str],
    tracebacks: int,
    elapsed_s: float,
) -> int:
    print(f"\nsoak result after {format_duration(elapsed_s)}")
    print("  requests by kind and status (0: cut or failed on the client's side, -1: no replica):")
    for (kind, status), n in sorted(results.statuses.items()):
        print(f"    {kind:<5} {status:>4}: {n}")
    for kind, values in sorted(results.latencies.items()):
        print(
            f"  {kind} latency p50 {percentile(values, 50) * 1000:.0f} ms, "
            f"p99 {percentile(values, 99) * 1000:.0f} ms, max {max(values, default=0):.1f} s"
        )
    print(f"  faults: {len(faults)} ({', '.join(f.kind for f in faults)})")
    print(
        f"  bodies checked: {results.bodies_checked} ({human_size(results.bytes_checked)}), "
        f"wrong: {len(results.wrong_bodies)}; cut short: {results.cut_bodies}; "
        f"connections refused (replica down): {results.connection_errors}"
    )
    print(f"  clients that waited over {SLOW_REQUEST_S:.0f} s: {len(results.slow)}")
    print(f"  500s (or other non-gateway 5xx): {len(results.server_errors)}")
    files = len(downloads)
    extra = sum(n - 1 for n in downloads.values())
    print(
        f"  upstream downloads: {sum(downloads.values())} for {files} files "
        f"({extra} repeated); over 1 + cutting faults: {len(too_many)}"
    )
    print(f"  leases still held: {held}; job runs left running: {len(stuck)} {stuck or ''}")
    print(f"  temp files left: {len(temp_files)}; tracebacks in the logs: {tracebacks}")
    print(f"  descriptors beyond the start, per replica: {fd_growth}")
    for index, series in sorted(rss.items()):
        shown = ", ".join(f"{v:.0f}" for v in series[:: max(1, len(series) // 12)])
        print(f"  RSS replica {index} (MiB, every {RSS_EVERY_S:.0f} s): {shown}")
    failures = []
    if results.wrong_bodies:
        failures.append(f"{len(results.wrong_bodies)} wrong bodies: {results.wrong_bodies[:5]}")
    if results.server_errors:
        failures.append(f"{len(results.server_errors)} 500s: {results.server_errors[:5]}")
    if held:
        failures.append(f"{held} leases still held")
    if stuck:
        failures.append(f"job runs left running: {stuck}")
    if temp_files:
        failures.append(f"{len(temp_files)} temp files left: {temp_files[:5]}")
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the replica logs")
    if too_many:
        failures.append(f"files downloaded too often: {too_many[:5]}")
    if any(growth > FD_GROWTH_ALLOWED for growth in fd_growth.values()):
        failures.append(f"descriptors left open: {fd_growth}")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("soak: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration", default="20m", help="how long the load runs (e.g. 2m, 20m)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--projects", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.duration_s = parse_duration(args.duration)
    raise SystemExit(asyncio.run(soak(args)))


if __name__ == "__main__":
    main()

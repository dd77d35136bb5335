"""Streaming across replicas (proxy/fetch/transfer.py; docs/architecture.md, "Streaming across
replicas" and "... on object storage"), with real `proxy serve` processes on one
Postgres and one shared folder, or one bucket and a local folder per replica (the
holder relays its download: proxy/fetch/relay.py, relayed.py).

Clients of a replica that waits on another's fetch lease get bytes as soon as the
holder has them; when the holder dies, they continue from the next download only if it
begins with the bytes they already have, and are cut otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.pgbouncer import FleetDb
from tests.processes import ProxyProcess
from tests.test_fleet import (
    Fleet,
    FleetStorage,
    fleet_config,
    fleet_db,
    fleet_storage,
    folder_storage,
    wait_for_holder,
)
from tests.upstream import FakeUpstream, ProjectFile

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MiB = 1024 * 1024
PATH = "/releases/tool-1.0.bin"
KEY = "tools/tool-1.0.bin"


TOOLS = """
[[repositories]]
name = "tools"
format = "raw"
upstream = "{upstream}/releases/"
"""

StartReplicas = Callable[..., list[ProxyProcess]]


# The fixtures: every test here runs as test_fleet.py's do (a folder, a bucket, and
# behind PgBouncer if marked so).
__all__ = ["fleet_db", "fleet_storage"]


def _starter(
    tmp_path: Path, db: FleetDb | str, upstream: FakeUpstream, storage: FleetStorage
) -> tuple[StartReplicas, list[Fleet]]:
    fleets: list[Fleet] = []

    def start_replicas(count: int, ttl: str = "2s") -> list[ProxyProcess]:
        config = fleet_config(
            tmp_path,
            db,
            upstream.base_url,
            ttl=ttl,
            read_timeout="10s",
            extra=TOOLS.format(upstream=upstream.base_url),
            name=f"fleet-{len(fleets)}.toml",
            storage=storage,
        )
        fleets.append(Fleet(tmp_path, config, storage.env))
        return fleets[-1].start(count)

    return start_replicas, fleets


@pytest.fixture
def start(
    tmp_path: Path, fleet_db: FleetDb, upstream: FakeUpstream, fleet_storage: FleetStorage
) -> Iterator[StartReplicas]:
    """``start(count, ttl=...)``: that many replicas on one database (reached directly,
    or behind PgBouncer) and one storage (a shared folder, or a bucket), serving the
    ``tools`` (raw) and ``pypi`` repositories from ``upstream``; stopped after the
    test."""
    start_replicas, fleets = _starter(tmp_path, fleet_db, upstream, fleet_storage)
    yield start_replicas
    for fleet in fleets:
        fleet.stop()


@pytest.fixture
def start_on_folder(tmp_path: Path, pg_url: str, upstream: FakeUpstream) -> Iterator[StartReplicas]:
    """``start``, on a shared folder only (tests that forge files in it)."""
    start_replicas, fleets = _starter(tmp_path, pg_url, upstream, folder_storage(tmp_path))
    yield start_replicas
    for fleet in fleets:
        fleet.stop()


@dataclass
class Pulled:
    """What one client got."""

    status: int
    sha256: str
    length: int
    ttfb: float  # seconds from the scenario's start to the first body byte
    ttlb: float  # ... to the last byte, or to the cut
    error: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    prefix: bytes = b""  # the first bytes received


async def pull(url: str, started_at: float, first_bytes: list[float] | None = None) -> Pulled:
    """``first_bytes``: the moment (monotonic) the first body byte came is added to it."""
    hasher, length, first, status, headers, prefix = hashlib.sha256(), 0, 0.0, 0, {}, b""
    try:
        async with httpx.AsyncClient(timeout=60) as client, client.stream("GET", url) as r:
            status, headers = r.status_code, dict(r.headers)
            async for chunk in r.aiter_bytes():
                if not first:
                    first = time.monotonic() - started_at
                    prefix = chunk[:64]
                    if first_bytes is not None:
                        first_bytes.append(time.monotonic())
                hasher.update(chunk)
                length += len(chunk)
    except httpx.HTTPError as exc:
        elapsed = time.monotonic() - started_at
        return Pulled(0, hasher.hexdigest(), length, first, elapsed, repr(exc), prefix=prefix)
    elapsed = time.monotonic() - started_at
    return Pulled(status, hasher.hexdigest(), length, first, elapsed, "", headers, prefix)


async def holder_then_waiters(
    holder: ProxyProcess,
    waiters: list[ProxyProcess],
    pg_url: str,
    clients_per_waiter: int,
    meanwhile: Callable[[], Awaitable[None]] | None = None,
    url: str = "/tools/tool-1.0.bin",
    key: str = KEY,
    first_bytes: list[float] | None = None,
) -> list[Pulled]:
    """One client on the holder; once it holds the lease, ``clients_per_waiter`` on each
    other replica; then ``meanwhile`` runs while they read. The holder's result first.
    ``first_bytes``: when each waiter's client had its first byte (``pull``)."""
    started_at = time.monotonic()
    clients = [asyncio.create_task(pull(holder.url + url, started_at))]
    await asyncio.to_thread(wait_for_holder, pg_url, key)
    for waiter in waiters:
        clients += [
            asyncio.create_task(pull(waiter.url + url, started_at, first_bytes))
            for _ in range(clients_per_waiter)
        ]
    if meanwhile is not None:
        await meanwhile()
    return list(await asyncio.gather(*clients))


@pytest.mark.pgbouncer
def test_waiting_replicas_stream_from_the_holders_first_bytes(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, start: StartReplicas
) -> None:
    body = os.urandom(6 * MiB)
    upstream.files[PATH] = body
    upstream.fault(PATH, chunk_size=256 * 1024, chunk_delay_s=0.1)  # ~2.5 MB/s: ~2.4 s
    holder, *waiters = start(3)

    results = asyncio.run(holder_then_waiters(holder, waiters, pg_url, 5))
    expected = hashlib.sha256(body).hexdigest()
    assert [(r.status, r.sha256, r.length) for r in results] == [(200, expected, len(body))] * 11
    holding, *waiting = results
    answer = {k: v for k, v in holding.headers.items() if k != "date"}
    assert answer["content-length"] == str(len(body))
    for r in waiting:
        # The same answer as the holder's client, and the first byte came while the
        # holder was still downloading, not after it: before the holder's own client
        # had the last byte (released once the download is verified), which a waiter
        # that is not streaming can only follow (it waits for the stored entry). An
        # order of events, not a share of a duration, which a loaded machine stretches.
        assert {k: v for k, v in r.headers.items() if k != "date"} == answer
        assert r.ttfb < holding.ttlb, (
            f"first byte after {r.ttfb:.2f} s of a {holding.ttlb:.2f} s download"
        )
    assert upstream.count(PATH) == 1
    waits = sum(w.metric("proxy_fetch_lease_waits_total", repository="tools") for w in waiters)
    assert waits >= 2


@pytest.mark.pgbouncer
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_clients_on_other_replicas_continue_when_the_holder_dies(
    tmp_path: Path,
    pg_url: str,
    upstream: FakeUpstream,
    start: StartReplicas,
    sig: signal.Signals,
) -> None:
    body = os.urandom(8 * MiB)
    upstream.files[PATH] = body
    upstream.fault(PATH, chunk_size=256 * 1024, chunk_delay_s=0.1)
    holder, *waiters = start(3)
    first_bytes: list[float] = []
    killed_at: list[float] = []

    async def kill_holder() -> None:
        # Once every client has part of the body (by events, not by a guess of how long
        # that takes on a loaded machine).
        for _ in range(1500):  # 30 s at most
            if len(first_bytes) == 6:
                break
            await asyncio.sleep(0.02)
        killed_at.append(time.monotonic())
        holder.signal(sig)

    results = asyncio.run(
        holder_then_waiters(holder, waiters, pg_url, 3, kill_holder, first_bytes=first_bytes)
    )[1:]
    expected = hashlib.sha256(body).hexdigest()
    assert [(r.status, r.sha256, r.length) for r in results] == [(200, expected, len(body))] * 6
    assert len(first_bytes) == 6 and max(first_bytes) <= killed_at[0], (
        "they had bytes before the holder died"
    )
    assert upstream.count(PATH) == 2  # the second download, by the replica that took over
    log = "".join(w.log() for w in waiters)
    assert "lease takeover" in log and "Traceback" not in log


def test_a_changed_body_cuts_the_clients_instead_of_splicing(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, start: StartReplicas
) -> None:
    first_body = os.urandom(8 * MiB)
    second_body = os.urandom(8 * MiB)  # same length, other bytes: the upstream changed it
    upstream.files[PATH] = first_body
    upstream.fault(PATH, chunk_size=256 * 1024, chunk_delay_s=0.1)
    holder, *waiters = start(3)

    async def change_and_kill() -> None:
        await asyncio.sleep(1.2)
        upstream.files[PATH] = second_body
        holder.signal(signal.SIGKILL)

    results = asyncio.run(holder_then_waiters(holder, waiters, pg_url, 3, change_and_kill))[1:]
    for r in results:
        assert r.length < len(first_body), "a complete body was delivered across two downloads"
        assert r.status == 0 and r.error, "the client was cut"
    # A client that comes now (the new download is still running: the cut came with its
    # first bytes) reads the new body whole, from that same download.
    for waiter in waiters:
        fresh = httpx.get(waiter.url + "/tools/tool-1.0.bin", timeout=60)
        assert fresh.status_code == 200 and fresh.content == second_body
    assert upstream.count(PATH) == 2
    log = "".join(w.log() for w in waiters)
    assert "does not begin with the" in log


@pytest.mark.pgbouncer
def test_a_digest_mismatch_at_the_end_cuts_every_replicas_clients_and_stores_nothing(
    tmp_path: Path,
    pg_url: str,
    upstream: FakeUpstream,
    start: StartReplicas,
    fleet_storage: FleetStorage,
) -> None:
    body = os.urandom(6 * MiB)
    upstream.add_project("big", [ProjectFile("big-1.0.tar.gz", body, listed_sha256="0" * 64)])
    upstream.fault("/packages/big-1.0.tar.gz", chunk_size=256 * 1024, chunk_delay_s=0.1)
    holder, *waiters = start(3)
    assert httpx.get(holder.url + "/pypi/simple/big/").status_code == 200

    results = asyncio.run(
        holder_then_waiters(
            holder,
            waiters,
            pg_url,
            3,
            url="/pypi/files/big/big-1.0.tar.gz",
            key="pypi/files/big/big-1.0.tar.gz",
        )
    )
    for r in results:
        assert r.length < len(body), "the last byte is never sent"
        assert r.status == 0 and r.error
        # Streaming, not waiting for the end: all but the last byte came before the cut
        # (the bytes are in order, so no clock is needed to tell).
        assert r.length >= len(body) // 2, "they were streaming"

    async def stored() -> int:
        conn = await asyncpg.connect(pg_url)
        try:
            count: int = await conn.fetchval(
                "SELECT count(*) FROM entries WHERE key LIKE '%big-1.0.tar.gz'"
            )
            return count
        finally:
            await conn.close()

    assert asyncio.run(stored()) == 0
    files = [p for p in tmp_path.glob("*/**/*") if p.is_file() and "pytest" not in p.name]
    assert [p for p in files if p.stat().st_size == len(body)] == [], "no blob, no temp file"
    if fleet_storage.kind == "s3":
        assert len(body) not in fleet_storage.objects().values(), "no object"


def open_temp_files(replica: ProxyProcess) -> list[str]:
    """The download files (``*.part``) a replica holds open: each pins disk space."""
    names = []
    for fd in Path(f"/proc/{replica.pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if ".part" in target:
                names.append(target)
    return names


@pytest.mark.parametrize("takeover", ["in one piece", "without a length", "404"])
def test_a_takeover_download_that_never_streams_still_ends_the_followers_clients(
    tmp_path: Path,
    pg_url: str,
    upstream: FakeUpstream,
    start: StartReplicas,
    takeover: str,
) -> None:
    """The replica that takes over gets the body in one write, or with no length (it
    never announces a file), or a 404: its clients and the other waiter's were reading the
    dead holder's file, and must end (whole, or cut), never wait forever."""
    body = os.urandom(40 * 1024)
    upstream.files[PATH] = body
    upstream.fault(PATH, chunk_size=4 * 1024, chunk_delay_s=0.2)  # ~2 s
    holder, *waiters = start(3)

    async def kill_then_change_upstream() -> None:
        await asyncio.sleep(1.0)
        holder.signal(signal.SIGKILL)
        if takeover == "in one piece":
            upstream.fault(PATH, chunk_size=MiB)  # one write: written == total at once
        elif takeover == "without a length":
            upstream.fault(PATH, chunked=True)
        else:
            del upstream.files[PATH]

    results = asyncio.run(
        holder_then_waiters(holder, waiters, pg_url, 2, kill_then_change_upstream)
    )
    expected = hashlib.sha256(body).hexdigest()
    for r in results[1:]:
        assert r.ttlb < 20, "the client waited for a source that never came"
        if takeover == "404":
            assert r.status == 0 and r.length < len(body), "cut: the body is gone upstream"
        else:
            assert (r.status, r.sha256, r.length) == (200, expected, len(body))
    later = httpx.get(waiters[0].url + "/tools/tool-1.0.bin", timeout=30)
    assert later.status_code == (404 if takeover == "404" else 200)
    time.sleep(1)  # the responses' cleanup
    assert [open_temp_files(w) for w in waiters] == [[], []]


@pytest.mark.pgbouncer
def test_a_follower_whose_holder_stores_the_entry_finishes_its_clients(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, start: StartReplicas
) -> None:
    """The waiter follows the holder's file (or relay) when the holder stores the entry
    and releases the lease: the wait ends in the entry, and the waiter's clients must
    get the last byte (from the very file they read, now the blob, or the stored object)
    with no second download. (This once slowed the waiter's claim with a trigger on its
    lease INSERTs; claims have been an UPDATE of the existing row since, which a follower
    never sends: a follower claims no more.) The lease TTL is long: this is not a test of
    expiry, and a 2 s TTL on a loaded machine once let the lease lapse and the waiter
    rightly download again."""
    body = os.urandom(2 * MiB)
    upstream.files[PATH] = body
    upstream.fault(PATH, chunk_size=128 * 1024, chunk_delay_s=0.1)  # ~1.6 s
    holder, waiter = start(2, ttl="20s")

    async def scenario() -> list[Pulled]:
        started_at = time.monotonic()
        url = "/tools/tool-1.0.bin"
        holding = asyncio.create_task(pull(holder.url + url, started_at))
        await asyncio.sleep(0.75)
        waiting = [asyncio.create_task(pull(waiter.url + url, started_at)) for _ in range(2)]
        return list(await asyncio.gather(holding, *waiting))

    results = asyncio.run(scenario())
    expected = hashlib.sha256(body).hexdigest()
    assert [(r.status, r.sha256, r.length) for r in results] == [(200, expected, len(body))] * 3
    # The wait found the entry: no second download (and no bound on time: CI's loaded
    # machine once took over 10 s on object storage).
    assert upstream.count(PATH) == 1


@pytest.mark.parametrize("forgery", ["symlink", "fifo", "short length"])
def test_forged_announcements_are_never_served(
    tmp_path: Path,
    pg_url: str,
    upstream: FakeUpstream,
    start_on_folder: StartReplicas,
    forgery: str,
) -> None:
    """Someone who can write the lease table or the shared folder names a symlink to a
    secret, a FIFO (whose open would block), or a shorter length: the waiter's clients
    get the real body or are cut, never other bytes, and the waiter keeps serving."""
    body = os.urandom(2 * MiB)
    upstream.files[PATH] = body
    upstream.fault(PATH, chunk_size=128 * 1024, chunk_delay_s=0.2)  # ~3.2 s
    holder, waiter = start_on_folder(2, ttl="3s")
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"SECRET " * 400_000)

    async def forge() -> None:
        conn = await asyncpg.connect(pg_url)
        try:
            row = None
            for _ in range(500):
                row = await conn.fetchrow(
                    "SELECT stream_file FROM fetch_leases WHERE key = $1 AND stream_file IS NOT NULL",
                    KEY,
                )
                if row is not None:
                    break
                await asyncio.sleep(0.01)
            assert row is not None, "the holder never announced its file"
            name = f"{uuid.uuid4().hex}.part"
            if forgery == "symlink":
                (tmp_path / "shared" / "tmp" / name).symlink_to(secret)
            elif forgery == "fifo":
                os.mkfifo(tmp_path / "shared" / "tmp" / name)
            if forgery == "short length":
                await conn.execute(
                    "UPDATE fetch_leases SET stream_length = $2 WHERE key = $1",
                    KEY,
                    len(body) - 1000,
                )
            else:
                await conn.execute(
                    "UPDATE fetch_leases SET stream_file = $2 WHERE key = $1", KEY, name
                )
        finally:
            await conn.close()

    async def scenario() -> list[Pulled]:
        started_at = time.monotonic()
        url = "/tools/tool-1.0.bin"
        holding = asyncio.create_task(pull(holder.url + url, started_at))
        await forge()
        waiting = [asyncio.create_task(pull(waiter.url + url, started_at)) for _ in range(2)]
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(timeout=10) as client:
            ready = await client.get(waiter.url + "/readyz?scope=local")
        assert ready.status_code == 200
        return list(await asyncio.gather(holding, *waiting))

    results = asyncio.run(scenario())
    expected = hashlib.sha256(body).hexdigest()
    assert (results[0].status, results[0].sha256) == (200, expected)
    for r in results[1:]:
        assert (r.status, r.sha256, r.length) == (200, expected, len(body)) or (
            r.status == 0 and r.length < len(body)
        ), r
        assert not r.prefix.startswith(b"SECRET")
    later = httpx.get(waiter.url + "/tools/tool-1.0.bin", timeout=30)
    assert later.status_code == 200 and later.content == body
    assert "event loop was blocked" not in waiter.log()

"""The relay (proxy/fetch/relay.py, relayed.py; docs/architecture.md, "Streaming across
replicas on object storage"): it serves only the in-flight download of the fence it is
asked for, to whoever holds that download's token, on a listener of its own; a waiter
connects only to a URL shaped like a relay's, takes bytes only from an answer that
proves it holds the token, and a forged lease row can neither make it serve other bytes
nor make it read from an arbitrary address."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from proxy.fetch.relay import PROOF_HEADER, proof
from proxy.upstream.ssrf import relay_target, relay_url_problem
from tests.processes import ProxyProcess
from tests.test_fleet import Fleet, FleetStorage, fleet_config
from tests.test_streaming import KEY, PATH, TOOLS, Pulled, pull
from tests.upstream import FakeUpstream

MiB = 1024 * 1024
URL = "/tools/tool-1.0.bin"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://10.1.2.3:9091", None),
        ("http://127.0.0.1:9091/", None),
        ("http://proxy-0.proxy.default.svc:9091", None),
        ("http://[fd00::5]:9091", None),
        ("https://10.1.2.3:9091", "not http://"),
        ("http://10.1.2.3", "has no port"),
        ("http://user:pw@10.1.2.3:9091", "has credentials"),
        ("http://10.1.2.3:9091/latest/meta-data", "has a path, query or fragment"),
        ("http://10.1.2.3:9091?x=1", "has a path, query or fragment"),
        ("http://169.254.169.254:80", "169.254.169.254 is no relay's address"),
        ("http://[::ffff:169.254.169.254]:80", "169.254.169.254 is no relay's address"),
        ("http://[fd00:ec2::254]:80", "fd00:ec2::254 is no relay's address"),
        ("http://0.0.0.0:9091", "0.0.0.0 is no relay's address"),
        ("http://224.0.0.1:9091", "224.0.0.1 is no relay's address"),
        ("http://[fe80::1]:9091", "fe80::1 is no relay's address"),
        ("http://bad_name:9091", "'bad_name' is not a host name"),
        ("http://10.1.2.3:99999", "not a URL"),
    ],
)
def test_relay_urls_are_checked_before_any_connection(url: str, problem: str | None) -> None:
    found = relay_url_problem(url)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.startswith(problem), found


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:9091", None),
        ("http://localhost:9091", None),
        # Numbers the resolver reads as addresses (inet_aton): the metadata address...
        ("http://2852039166:80", "2852039166 resolves to 169.254.169.254"),
        ("http://0xa9fea9fe:80", "0xa9fea9fe resolves to 169.254.169.254"),
        ("http://0251.0376.0251.0376:80", "0251.0376.0251.0376 resolves to 169.254.169.254"),
        ("http://169.254.43518:80", "169.254.43518 resolves to 169.254.169.254"),
        # ... and the unspecified one, which connects to this host.
        ("http://0:9091", "0 resolves to 0.0.0.0"),
        ("http://[64:ff9b::a9fe:a9fe]:80", "169.254.169.254 is no relay's address"),
        ("http://no-such-relay.invalid:9091", "upstream no-such-relay.invalid cannot be"),
    ],
)
def test_relay_names_are_resolved_and_pinned_before_any_connection(
    url: str, problem: str | None
) -> None:
    target, found = asyncio.run(relay_target(url))
    if problem is None:
        assert found is None and target == "http://127.0.0.1:9091"
    else:
        assert target is None and found is not None and found.startswith(problem), found


@pytest.fixture
def s3_fleet(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, seaweedfs: Any, s3_bucket: str
) -> Any:
    from tests.conftest import s3_storage

    local = Path(f"{tmp_path}/local-${{REPLICA_NAME}}")
    keys = f'path = "{tmp_path / "data"}"\n' + s3_storage(seaweedfs, s3_bucket, local)
    storage = FleetStorage("s3", keys, seaweedfs.env, s3_bucket, seaweedfs)
    fleets: list[Fleet] = []

    def start(count: int, ttl: str = "3s") -> list[ProxyProcess]:
        config = fleet_config(
            tmp_path, pg_url, upstream.base_url, ttl=ttl, read_timeout="10s",
            extra=TOOLS.format(upstream=upstream.base_url), storage=storage,
            name=f"fleet-{len(fleets)}.toml",
        )  # fmt: skip
        fleets.append(Fleet(tmp_path, config, storage.env))
        return fleets[-1].start(count)

    yield start
    for fleet in fleets:
        fleet.stop()


async def announced(pg_url: str) -> asyncpg.Record:
    conn = await asyncpg.connect(pg_url)
    try:
        for _ in range(1000):
            row = await conn.fetchrow(
                "SELECT fence, stream_relay, stream_token, stream_length FROM fetch_leases "
                "WHERE key = $1 AND stream_relay IS NOT NULL",
                KEY,
            )
            if row is not None:
                return row
            await asyncio.sleep(0.01)
    finally:
        await conn.close()
    raise AssertionError("the holder never announced its relay")


def test_the_relay_serves_only_the_offered_download_to_its_token(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, s3_fleet: Any
) -> None:
    body = os.urandom(2 * MiB)
    upstream.files[PATH] = body
    upstream.fault(PATH, chunk_size=128 * 1024, chunk_delay_s=0.1)  # ~1.6 s
    [holder] = s3_fleet(1)

    async def scenario() -> dict[str, Any]:
        started = time.monotonic()
        holding = asyncio.create_task(pull(holder.url + URL, started))
        row = await announced(pg_url)
        relay, token, fence = row["stream_relay"], row["stream_token"], row["fence"]
        assert relay.startswith("http://127.0.0.1:") and relay != holder.url
        assert len(token) >= 43  # 32 random bytes
        out: dict[str, Any] = {}
        async with httpx.AsyncClient(timeout=30) as client:
            bearer = {"authorization": f"Bearer {token}"}
            out["wrong token"] = await client.get(
                f"{relay}/relay/{fence}", headers={"authorization": "Bearer " + "x" * len(token)}
            )
            out["no token"] = await client.get(f"{relay}/relay/{fence}")
            out["other fence"] = await client.get(f"{relay}/relay/{fence + 1}", headers=bearer)
            out["other path"] = await client.get(f"{relay}/relay/../blobs", headers=bearer)
            out["not a fence"] = await client.get(f"{relay}/relay/{fence}x", headers=bearer)
            out["post"] = await client.post(f"{relay}/relay/{fence}", headers=bearer)
            out["public port"] = await client.get(f"{holder.url}/relay/{fence}", headers=bearer)
            out["range"] = await client.get(
                f"{relay}/relay/{fence}", headers={**bearer, "range": f"bytes={MiB}-"}
            )
            out["bad range"] = await client.get(
                f"{relay}/relay/{fence}", headers={**bearer, "range": "bytes=0-10"}
            )
            out["whole"] = await client.get(f"{relay}/relay/{fence}", headers=bearer)
            out["fence"], out["token"] = fence, token
            await holding
            assert (await client.head(holder.url + URL)).status_code == 200  # recorded
            out["after"] = await client.get(f"{relay}/relay/{fence}", headers=bearer)
        return out

    got = asyncio.run(scenario())
    assert got["wrong token"].status_code == 403
    assert got["no token"].status_code == 403
    for refused in ("other fence", "other path", "not a fence", "post", "after"):
        assert got[refused].status_code == 404, refused
    assert got["public port"].status_code == 404  # not on the port the load balancer sees
    assert got["bad range"].status_code == 416
    whole, ranged = got["whole"], got["range"]
    assert whole.status_code == 206 and whole.content == body
    assert whole.headers[PROOF_HEADER] == proof(got["token"], got["fence"], 0, len(body))
    assert ranged.status_code == 206 and ranged.content == body[MiB:]
    assert ranged.headers["content-range"] == f"bytes {MiB}-{len(body) - 1}/{len(body)}"
    assert holder.metric("proxy_relay_requests_total", result="forbidden") == 2


@pytest.mark.parametrize(
    "forgery", ["wrong token", "other fence", "arbitrary server", "metadata", "metadata by number"]
)
def test_forged_relay_announcements_are_never_served(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, s3_fleet: Any, forgery: str
) -> None:
    """Someone who can write the lease table points the waiter at a wrong token, another
    fence, a server of theirs that answers anything (here the fake upstream, with a
    secret at every relay path), or the cloud metadata address: the waiter's clients get
    the real body (from the entry) or are cut, never other bytes."""
    body = os.urandom(2 * MiB)
    upstream.files[PATH] = body
    upstream.fault(PATH, chunk_size=128 * 1024, chunk_delay_s=0.2)  # ~3.2 s
    secret = b"SECRET " * 300_000
    holder, waiter = s3_fleet(2, ttl="3s")

    async def forge() -> int:
        row = await announced(pg_url)
        fence = row["fence"]
        if forgery == "arbitrary server":
            for n in range(fence, fence + 50):
                upstream.files[f"/relay/{n}"] = secret
        conn = await asyncpg.connect(pg_url)
        try:
            if forgery == "wrong token":
                change, value = "stream_token", "y" * 43
            elif forgery == "other fence":
                change, value = "stream_relay", row["stream_relay"]  # and the fence below
                await conn.execute(
                    "UPDATE fetch_leases SET fence = fence + 1000 WHERE key = $1", KEY
                )
            elif forgery == "arbitrary server":
                change, value = "stream_relay", upstream.base_url
            elif forgery == "metadata":
                change, value = "stream_relay", "http://169.254.169.254:80"
            else:
                change, value = "stream_relay", "http://2852039166:80"  # the same, as a number
            await conn.execute(f"UPDATE fetch_leases SET {change} = $2 WHERE key = $1", KEY, value)
        finally:
            await conn.close()
        return int(fence)

    async def scenario() -> list[Pulled]:
        started_at = time.monotonic()
        holding = asyncio.create_task(pull(holder.url + URL, started_at))
        await forge()
        waiting = [asyncio.create_task(pull(waiter.url + URL, started_at)) for _ in range(2)]
        return list(await asyncio.gather(holding, *waiting))

    results = asyncio.run(scenario())
    expected = hashlib.sha256(body).hexdigest()
    assert (results[0].status, results[0].sha256) == (200, expected)
    for r in results[1:]:
        assert (r.status, r.sha256, r.length) == (200, expected, len(body)) or (
            r.status == 0 and r.length < len(body)
        ), r
        assert not r.prefix.startswith(b"SECRET")
    later = httpx.get(waiter.url + URL, timeout=30)
    assert later.status_code == 200 and later.content == body
    log = waiter.log()
    assert "Traceback" not in log
    if forgery.startswith("metadata"):
        assert "ignoring a relay announcement" in log
        assert waiter.metric("proxy_relay_follows_total", result="refused") >= 1
    if forgery == "arbitrary server":
        assert waiter.metric("proxy_relay_follows_total", result="unproven") >= 1
        # Not one byte of its answer was taken: nothing of it in the waiter's folder.
        local = tmp_path / f"local-{waiter.name}"
        assert not [p for p in local.rglob("*") if p.is_file() and p.read_bytes()[:6] == b"SECRET"]
    if forgery == "wrong token":
        assert holder.metric("proxy_relay_requests_total", result="forbidden") >= 1


def test_a_waiter_stopped_while_it_follows_a_relay_stops_cleanly(
    tmp_path: Path, pg_url: str, upstream: FakeUpstream, s3_fleet: Any
) -> None:
    """SIGTERM to a replica whose clients read another's relay: its copy is dropped, its
    clients are cut, it exits 0 without a traceback (its task group is closing while the
    relayed copy is closed), and the holder goes on."""
    import signal

    body = os.urandom(4 * MiB)
    upstream.files[PATH] = body
    upstream.fault(PATH, chunk_size=128 * 1024, chunk_delay_s=0.1)  # ~3.2 s
    holder, waiter = s3_fleet(2)

    async def scenario() -> list[Pulled]:
        started = time.monotonic()
        holding = asyncio.create_task(pull(holder.url + URL, started))
        await announced(pg_url)
        waiting = asyncio.create_task(pull(waiter.url + URL, started))
        while waiter.metric("proxy_relay_follows_total", result="started") < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        waiter.signal(signal.SIGTERM)
        return list(await asyncio.gather(holding, waiting))

    holding, waiting = asyncio.run(scenario())
    assert (holding.status, holding.sha256) == (200, hashlib.sha256(body).hexdigest())
    assert waiting.length < len(body)  # cut by the stop
    assert waiter.wait(30) == 0
    assert "Traceback" not in waiter.log()

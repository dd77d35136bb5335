"""The console's fleet-wide view with real replicas on one Postgres (proxy/fleet.py):
every replica's heartbeat row, downloads in progress on another replica from its lease
row, hits counted on each replica summed, and a purge on one replica reaching the
others within a heartbeat (what they remember of the repository is forgotten)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from proxy.fleet import HEARTBEAT_INTERVAL_S
from tests.admin_support import AUTH, PASSWORD, wait_until
from tests.processes import ProxyProcess, start_replicas
from tests.test_fleet import fleet_config
from tests.upstream import FakeUpstream, ProjectFile

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ADMIN = f'[admin]\n[admin.users.ops]\npassword = "{PASSWORD}"\n'


def test_two_replicas_seen_from_either(tmp_path: Path, upstream: FakeUpstream, pg_url: str) -> None:
    big = b"y" * (3 * 1024 * 1024)
    upstream.add_project("alpha", [ProjectFile("alpha-1.0.tar.gz", b"alpha")])
    upstream.add_project("huge", [ProjectFile("huge-1.0.tar.gz", big)])
    config = fleet_config(tmp_path, pg_url, upstream.base_url, extra=ADMIN, ttl="3s")
    started: list[ProxyProcess] = []
    try:
        a, b = start_replicas(started, config, tmp_path, 2)
        api_a = httpx.Client(base_url=a.url, auth=AUTH, timeout=30)
        api_b = httpx.Client(base_url=b.url, auth=AUTH, timeout=30)
        replicas = api_b.get("/api/v1/replicas").json()["replicas"]
        assert len(replicas) == 2 and all(r["alive"] for r in replicas)
        assert {r["url"] for r in replicas} == {a.url, b.url}

        # A negative entry that replica B remembers in memory...
        assert httpx.get(f"{b.url}/pypi/simple/ghost/").status_code == 404
        assert httpx.get(f"{b.url}/pypi/simple/ghost/").status_code == 404
        assert upstream.count("/simple/ghost/") == 1
        # ... purged on replica A: within a heartbeat, B asks the upstream again.
        assert api_a.delete("/api/v1/packages/pypi/ghost").json()["deleted"] == 1
        wait_until(
            "replica B to forget the purged package",
            lambda: (
                httpx.get(f"{b.url}/pypi/simple/ghost/").status_code == 404
                and upstream.count("/simple/ghost/") == 2
            ),
            timeout_s=HEARTBEAT_INTERVAL_S * 2 + 10,
        )

        # A download held by replica A, seen in flight from replica B.
        assert httpx.get(f"{a.url}/pypi/simple/huge/").status_code == 200
        upstream.fault("/packages/huge-1.0.tar.gz", chunk_size=64 * 1024, chunk_delay_s=0.1)
        done: list[int] = []
        client = threading.Thread(
            target=lambda: done.append(
                len(httpx.get(f"{a.url}/pypi/files/huge/huge-1.0.tar.gz", timeout=120).content)
            )
        )
        client.start()
        holder_a = next(r["holder"] for r in replicas if r["url"] == a.url)
        row = wait_until(
            "replica A's download in B's view",
            lambda: next((d for d in api_b.get("/api/v1/in-flight").json()["in_flight"]
                          if d["key"] == "pypi/files/huge/huge-1.0.tar.gz" and d["bytes"]), None),
        )  # fmt: skip
        assert row["holder"] == holder_a and row["length"] == len(big)
        client.join(120)
        assert done == [len(big)]

        # Hits on A, counted in B's stats once A's heartbeat carried them.
        for _ in range(3):
            assert httpx.get(f"{a.url}/pypi/files/alpha/alpha-1.0.tar.gz").status_code == 200
        wait_until(
            "A's hits in B's stats",
            lambda: next(r for r in api_b.get("/api/v1/stats").json()["repositories"]
                         if r["name"] == "pypi")["hits"] >= 2,
            timeout_s=HEARTBEAT_INTERVAL_S * 2 + 10,
        )  # fmt: skip
        page = api_b.get("/ui/")
        assert page.status_code == 200 and "Healthy" in page.text and a.url in page.text

        api_a.close()
        api_b.close()
    finally:
        for process in started:
            process.stop()


def test_a_replica_whose_heartbeat_is_old_is_gone() -> None:
    from proxy.admin.overview import _replica
    from proxy.catalog import Replica
    from proxy.fleet import REPLICA_GONE_AFTER_S

    seen = 1_000_000
    row = Replica("h:1:x", "h", 1, "http://h:8080", "0.1.0", 0, seen, {}, seen)
    assert _replica(row)["alive"]
    late = Replica(
        "h:1:x",
        "h",
        1,
        "http://h:8080",
        "0.1.0",
        0,
        seen,
        {},
        seen + int(REPLICA_GONE_AFTER_S * 1000) + 1,
    )
    assert not _replica(late)["alive"]

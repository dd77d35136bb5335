"""Blobs in a bucket (proxy/storage/objects.py, proxy/fetch/fill.py; docs/architecture.md,
"Object storage"), against a real S3 server (SeaweedFS): misses upload verified bytes
to the final key before the entry is recorded, hits read the local tier with no request
and a cold hit makes one GET, shared by every client that comes meanwhile, verified
before its last byte."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from proxy.config.load import load
from tests.conftest import ProxyFactory, s3_storage, write_config
from tests.seaweed import SeaweedFS
from tests.upstream import FakeUpstream, ServerThread

MiB = 1024 * 1024
PATH = "/releases/tool-1.0.bin"  # no digest verifies it: a name of no kind to check
URL = "/tools/tool-1.0.bin"


def requests(operation: str | None = None) -> float:
    """S3 requests this test process has sent, of one operation or all."""
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name != "proxy_storage_requests":
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total") and (
                operation is None or sample.labels.get("operation") == operation
            ):
                total += sample.value
    return total


def object_config(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    bucket: str,
    replica: str = "a",
    extra_s3: str = "",
    extra: str = "",
    endpoint: str | None = None,
) -> Path:
    """One replica's config: a shared catalog and bucket, a local cache of its own."""
    return write_config(
        tmp_path,
        f"""
        [database]
        url = "sqlite:///{tmp_path / "catalog.db"}"
        [storage]
        path = "{tmp_path / "data"}"
        {s3_storage(seaweedfs, bucket, tmp_path / f"local-{replica}", extra_s3, endpoint=endpoint)}
        [upstream]
        connect_timeout = "2s"
        read_timeout = "5s"
        retries = 0
        {extra}
        [[repositories]]
        name = "tools"
        format = "raw"
        upstream = "{upstream.base_url}/releases/"
        """,
        name=f"{replica}.toml",
    )


def start(
    start_proxy: ProxyFactory,
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    bucket: str,
    replica: str = "a",
    **kw: str,
) -> ServerThread:
    """A proxy whose start-up jobs (reclaim lists the bucket) are done, so that what the
    test counts afterwards is what its requests cost."""
    config = object_config(tmp_path, upstream, seaweedfs, bucket, replica, **kw)
    proxy = start_proxy(load(config, {}))
    deadline = time.monotonic() + 30
    while True:
        with sqlite3.connect(tmp_path / "catalog.db") as db:
            done = db.execute(
                "SELECT count(*) FROM job_runs WHERE name IN ('reclaim', 'evict') "
                "AND outcome = 'ok'"
            ).fetchone()[0]
        if done == 2:
            break
        assert time.monotonic() < deadline, "the start-up jobs did not run"
        time.sleep(0.02)
    return proxy


def blob_key(body: bytes) -> str:
    sha = hashlib.sha256(body).hexdigest()
    return f"proxy/blobs/{sha[:2]}/{sha[2:4]}/{sha}"


def test_a_miss_uploads_the_verified_body_and_hits_read_the_local_copy(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    body = os.urandom(3 * MiB)
    upstream.files[PATH] = body
    proxy = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket)
    before = requests()
    miss = httpx.get(proxy.url + URL)
    assert miss.status_code == 200 and miss.content == body
    # A request now joins the download, verified: it is answered once the entry is
    # recorded, which happens only after the upload.
    assert httpx.head(proxy.url + URL).status_code == 200
    assert seaweedfs.keys(s3_bucket, "proxy/") == {blob_key(body): len(body)}
    assert requests() - before == 1  # one PUT (3 MiB: no multipart); no HEAD, no LIST
    sha = hashlib.sha256(body).hexdigest()
    local = tmp_path / "local-a" / "blobs" / sha[:2] / sha[2:4] / sha
    assert local.read_bytes() == body
    assert list((tmp_path / "local-a" / "tmp").iterdir()) == []

    before = requests()
    for _ in range(3):
        hit = httpx.get(proxy.url + URL)
        assert hit.status_code == 200 and hit.content == body
    head = httpx.head(proxy.url + URL)
    assert head.headers["content-length"] == str(len(body))
    assert requests() == before, "a hit on the local tier asks the bucket nothing"


def test_a_cold_hit_is_one_get_shared_by_concurrent_clients_and_streams(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    body = os.urandom(20 * MiB)
    upstream.files[PATH] = body
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a")
    assert httpx.get(a.url + URL).content == body  # stored by replica a
    assert httpx.head(a.url + URL).status_code == 200  # (once recorded)
    b = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "b")  # no local copy

    async def many() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(timeout=60) as client:

            async def one() -> tuple[int, str]:
                response = await client.get(b.url + URL)
                return response.status_code, hashlib.sha256(response.content).hexdigest()

            return await asyncio.gather(*(one() for _ in range(10)))

    before_get, before_all = requests("get"), requests()
    results = asyncio.run(many())
    assert results == [(200, hashlib.sha256(body).hexdigest())] * 10
    assert requests("get") - before_get == 1, "one GET for every concurrent cold hit"
    assert requests() - before_all == 1, "and nothing else: no HEAD, no LIST"
    assert upstream.count(PATH) == 1
    before = requests()
    assert httpx.get(b.url + URL).content == body
    assert requests() == before, "the cold hit filled b's local tier"


def test_range_if_range_304_and_head_on_a_cold_hit_answer_as_the_folder_store_does(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    body = os.urandom(2 * MiB + 123)
    upstream.files[PATH] = body
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a")
    assert httpx.get(a.url + URL).content == body  # the miss (streamed: no ETag yet)
    assert httpx.head(a.url + URL).status_code == 200  # (once recorded)
    stored = httpx.get(a.url + URL)
    etag, modified = stored.headers["etag"], stored.headers["last-modified"]
    asks = [
        ("GET", {"range": "bytes=100-199"}),
        ("GET", {"range": "bytes=-50"}),
        ("GET", {"range": f"bytes={len(body) - 10}-"}),
        ("GET", {"range": "bytes=100-199", "if-range": etag}),
        ("GET", {"range": "bytes=100-199", "if-range": '"other"'}),
        ("GET", {"range": f"bytes={len(body) + 5}-"}),
        ("GET", {"if-none-match": etag}),
        ("GET", {"if-modified-since": modified}),
        ("HEAD", {}),
        ("HEAD", {"range": "bytes=0-9"}),
        ("GET", {}),
    ]

    def answers(proxy: ServerThread) -> list[tuple[int, dict[str, str], bytes]]:
        got = []
        for method, headers in asks:
            r = httpx.request(method, proxy.url + URL, headers=headers, timeout=30)
            kept = {k: v for k, v in r.headers.items() if k != "date"}
            got.append((r.status_code, kept, r.content))
        return got

    on_the_tier = answers(a)
    for fresh in ("b", "c"):  # each ask is a cold hit on a replica without a local copy
        cold = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, fresh)
        before = requests()
        first, second = asks[6], asks[8]
        for method, headers in (first, second):  # 304 and HEAD: the catalog knows
            r = httpx.request(method, cold.url + URL, headers=headers)
            assert r.status_code in (200, 304)
        assert requests() == before, "neither a 304 nor a HEAD touches the bucket"
    cold = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "d")
    assert answers(cold) == on_the_tier
    assert on_the_tier[0][0] == 206 and on_the_tier[0][2] == body[100:200]
    assert on_the_tier[2][2] == body[-10:] and on_the_tier[5][0] == 416


def test_a_corrupt_object_cuts_its_clients_and_the_next_request_fetches_again(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    body = os.urandom(4 * MiB)
    upstream.files[PATH] = body
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a")
    assert httpx.get(a.url + URL).content == body
    assert httpx.head(a.url + URL).status_code == 200  # recorded
    damaged = bytearray(body)
    damaged[-1] ^= 0xFF  # same length, one byte wrong
    seaweedfs.put(s3_bucket, blob_key(body), bytes(damaged))
    b = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "b")
    with pytest.raises(httpx.HTTPError), httpx.stream("GET", b.url + URL) as r:
        received = b"".join(r.iter_bytes())
        assert len(received) < len(body)
        raise AssertionError("the whole body was sent")
    sha = hashlib.sha256(body).hexdigest()
    assert not (tmp_path / "local-b" / "blobs" / sha[:2] / sha[2:4] / sha).exists()
    again = httpx.get(b.url + URL)
    assert again.status_code == 200 and again.content == body
    assert upstream.count(PATH) == 2  # forgotten, then fetched again
    assert seaweedfs.get(s3_bucket, blob_key(body)) == body  # and stored right


def test_an_object_gone_under_a_recorded_entry_is_fetched_again(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    body = os.urandom(1 * MiB)
    upstream.files[PATH] = body
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a")
    assert httpx.get(a.url + URL).content == body
    assert httpx.head(a.url + URL).status_code == 200  # recorded
    seaweedfs.delete(s3_bucket, blob_key(body))  # a purge that raced a re-upload
    b = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "b")
    for method in ("GET", "GET"):
        answer = httpx.request(method, b.url + URL)
        assert answer.status_code == 200 and answer.content == body
    assert upstream.count(PATH) == 2
    assert seaweedfs.get(s3_bucket, blob_key(body)) == body


def tier_path(tmp_path: Path, replica: str, body: bytes) -> Path:
    sha = hashlib.sha256(body).hexdigest()
    return tmp_path / f"local-{replica}" / "blobs" / sha[:2] / sha[2:4] / sha


def wait_for_whole_copy(copy: Path, body: bytes) -> None:
    """A local copy joins the tier just after its last byte is released to the client:
    a moment after the client has it all."""
    deadline = time.monotonic() + 30
    while not (copy.is_file() and not copy.is_symlink() and copy.read_bytes() == body):
        assert time.monotonic() < deadline, f"no good local copy at {copy}"
        time.sleep(0.02)


def unblock_fifo(path: Path) -> None:
    """Let a reader blocked opening the FIFO at ``path`` go (so a failing test ends)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # nobody is reading it
    os.close(fd)


def test_a_local_copy_damaged_under_a_running_replica_is_read_from_the_bucket_again(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    """The local tier is a cache of the bucket: a copy truncated, or replaced by a
    symlink, under a running replica is never served (short, or someone else's bytes
    with the blob's ETag); it is dropped and the object read again, once."""
    short, linked = os.urandom(2 * MiB), os.urandom(2 * MiB)
    upstream.files["/releases/short.bin"] = short
    upstream.files[PATH] = linked
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a")
    files = (("/tools/short.bin", short), (URL, linked))
    for url, body in files:
        assert httpx.get(a.url + url).content == body
        assert httpx.head(a.url + url).status_code == 200  # recorded
    with tier_path(tmp_path, "a", short).open("r+b") as fh:
        fh.truncate(len(short) // 2)
    other = tmp_path / "other-bytes"
    other.write_bytes(os.urandom(len(linked)))  # the same size: only the link tells
    tier_path(tmp_path, "a", linked).unlink()
    tier_path(tmp_path, "a", linked).symlink_to(other)
    before = requests("get")
    for url, body in files:
        got = httpx.get(a.url + url, timeout=30)
        assert got.status_code == 200 and got.content == body, url
    assert requests("get") - before == 2, "each damaged copy is read from the bucket again"
    for _url, body in files:
        wait_for_whole_copy(tier_path(tmp_path, "a", body), body)
    before = requests()
    for url, body in files:
        assert httpx.get(a.url + url).content == body
    assert requests() == before, "and serves again with no request"
    assert upstream.count(PATH) == 1 and upstream.count("/releases/short.bin") == 1


def test_a_local_cache_holding_junk_links_and_a_fifo_at_start_serves_only_the_blobs(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    """A replica started on a local_cache folder that holds what it never wrote there
    (files of other names, a directory, a FIFO, a symlink and short files at blobs'
    names) starts, never blocks on the FIFO, and serves every blob's own bytes: small
    ones (read whole, kept in memory) and large ones (sent from the file) alike."""
    names = {
        "fifo": os.urandom(1000),
        "link": os.urandom(MiB),
        "short-small": os.urandom(100 * 1024),
        "short-big": os.urandom(MiB),
    }
    for name, body in names.items():
        upstream.files[f"/releases/{name}.bin"] = body
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a")
    for name, body in names.items():
        assert httpx.get(f"{a.url}/tools/{name}.bin").content == body
        assert httpx.head(f"{a.url}/tools/{name}.bin").status_code == 200  # recorded
    blobs = tmp_path / "local-b" / "blobs"
    (blobs / "ab" / "cd").mkdir(parents=True)
    (blobs / "ab" / "cd" / "not-a-blob").write_bytes(b"junk")
    (blobs / "junk.txt").write_bytes(b"junk")
    (blobs / "ab" / "cd" / ("ab" * 32)).mkdir()  # a directory named like a blob
    for body in names.values():
        tier_path(tmp_path, "b", body).parent.mkdir(parents=True, exist_ok=True)
    fifo = tier_path(tmp_path, "b", names["fifo"])
    os.mkfifo(fifo)
    other = tmp_path / "other-bytes"
    other.write_bytes(os.urandom(MiB))
    tier_path(tmp_path, "b", names["link"]).symlink_to(other)
    for name in ("short-small", "short-big"):
        tier_path(tmp_path, "b", names[name]).write_bytes(names[name][:1000])
    try:
        b = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "b")
        for name, body in names.items():
            got = httpx.get(f"{b.url}/tools/{name}.bin", timeout=10)
            assert got.status_code == 200 and got.content == body, name
    finally:
        unblock_fifo(fifo)
    for body in names.values():
        wait_for_whole_copy(tier_path(tmp_path, "b", body), body)
    assert len(other.read_bytes()) == MiB, "the link's target was never written"
    assert sum(upstream.count(f"/releases/{name}.bin") for name in names) == len(names)

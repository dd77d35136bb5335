"""Object storage that fails (proxy/storage/s3.py, objects.py; docs/architecture.md,
"Object storage"), for real: SeaweedFS stopped, paused (SIGSTOP), throttling through a
fault injector in front of it, wrong credentials, a missing bucket, and a proxy killed
during its upload. Throttling is retried within a bounded time; while the bucket is
down, local copies keep serving, a file only in the bucket is a 503 that says why, a
miss is passed through but never recorded as stored, and /readyz names the storage."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import pytest

from tests.conftest import ProxyFactory
from tests.pg import free_port
from tests.processes import ProxyProcess
from tests.s3_faults import S3Faults, start_faults
from tests.seaweed import SeaweedFS
from tests.test_object_storage import PATH, URL, blob_key, object_config, requests, start
from tests.upstream import FakeUpstream

pytestmark = pytest.mark.slow

MiB = 1024 * 1024


@pytest.fixture
def faults(seaweedfs: SeaweedFS) -> Iterator[S3Faults]:
    injector, server = start_faults(seaweedfs.endpoint)
    injector.endpoint = server.url  # type: ignore[attr-defined]
    yield injector
    injector.released.set()
    server.stop()


def entries(tmp_path: Path) -> list[str]:
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        return [r[0] for r in db.execute("SELECT key FROM entries WHERE kind = 'immutable'")]


def test_throttling_is_retried_and_a_bucket_that_keeps_refusing_is_a_503_saying_so(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
    faults: S3Faults,
) -> None:
    body = os.urandom(MiB)
    upstream.files[PATH] = body
    endpoint = faults.endpoint  # type: ignore[attr-defined]
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a", endpoint=endpoint)
    faults.slow_down["put"] = 2
    puts = requests("put")
    assert httpx.get(a.url + URL).content == body
    assert httpx.head(a.url + URL).status_code == 200  # recorded
    assert requests("put") - puts == 3, "two SlowDowns, then the upload"
    assert seaweedfs.keys(s3_bucket, "proxy/blobs/") == {blob_key(body): len(body)}

    b = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "b", endpoint=endpoint)
    faults.slow_down["get"] = 2
    gets = requests("get")
    assert httpx.get(b.url + URL, timeout=60).content == body  # a cold hit, retried
    assert requests("get") - gets == 3

    c = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "c", endpoint=endpoint)
    faults.slow_down["get"] = 10**6  # throttled for good
    refused = httpx.get(c.url + URL, timeout=60)
    assert refused.status_code == 503 and "object storage" in refused.text
    assert int(refused.headers["retry-after"]) > 0
    assert refused.headers["cache-control"] == "no-store"
    assert upstream.count(PATH) == 1, "an unavailable bucket is never a reason to refetch"
    assert httpx.get(a.url + URL).content == body  # a local copy asks nothing
    faults.slow_down.clear()
    assert httpx.get(c.url + URL, timeout=60).content == body


@pytest.mark.parametrize("how", ["stopped", "paused"])
def test_while_the_bucket_is_down_local_copies_serve_and_nothing_is_recorded(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
    how: str,
) -> None:
    cached, big, small = os.urandom(2 * MiB), os.urandom(4 * MiB), os.urandom(1000)
    upstream.files[PATH] = cached
    upstream.files["/releases/big.bin"] = big
    upstream.files["/releases/small.bin"] = small
    upstream.fault("/releases/big.bin", chunk_size=256 * 1024, chunk_delay_s=0.02)
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a")
    b = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "b")
    assert httpx.get(a.url + URL).content == cached
    assert httpx.head(a.url + URL).status_code == 200  # recorded
    assert httpx.get(a.url + "/readyz").status_code == 200
    try:
        if how == "stopped":
            seaweedfs.stop()
        else:
            seaweedfs.pause()
        hit = httpx.get(a.url + URL, timeout=60)
        assert hit.status_code == 200 and hit.content == cached, "the local copy serves"
        head = httpx.head(b.url + URL, timeout=60)
        assert head.status_code == 200 and head.headers["content-length"] == str(len(cached))
        cold = httpx.get(b.url + URL, timeout=60)
        assert cold.status_code == 503 and "object storage" in cold.text, cold.text
        assert "retry-after" in cold.headers
        streamed = httpx.get(a.url + "/tools/big.bin", timeout=60)
        assert streamed.status_code == 200 and streamed.content == big, "passed through"
        whole = httpx.get(a.url + "/tools/small.bin", timeout=60)
        assert whole.status_code == 503 and "object storage" in whole.text
        ready = httpx.get(a.url + "/readyz", timeout=60)
        assert ready.status_code == 503 and "storage:" in ready.text, ready.text
        assert s3_bucket in ready.text or "object storage" in ready.text
        assert httpx.get(a.url + "/readyz?scope=local").status_code == 200
        assert sorted(entries(tmp_path)) == ["tool-1.0.bin"], "nothing recorded as stored"
    finally:
        if how == "stopped":
            seaweedfs.start()
        else:
            seaweedfs.resume()
    deadline = time.monotonic() + 30
    while httpx.get(a.url + "/readyz", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "readiness did not come back"
        time.sleep(0.5)
    again = httpx.get(a.url + "/tools/small.bin", timeout=60)
    assert again.status_code == 200 and again.content == small
    assert httpx.get(b.url + URL, timeout=60).content == cached


def serve_exits(config: Path, env: dict[str, str]) -> tuple[int, str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "proxy",
        "serve",
        "--config",
        str(config),
        "--listen",
        f"127.0.0.1:{port}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    return done.returncode, done.stderr


def test_wrong_credentials_or_a_missing_bucket_stop_the_start_naming_the_setting(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    clean_env: dict[str, str],
) -> None:
    env = {**clean_env, **seaweedfs.env}
    config = object_config(tmp_path, upstream, seaweedfs, s3_bucket)
    status, err = serve_exits(config, {**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    assert status == 1 and "storage.url" in err and "access denied" in err, err
    assert "not-the-secret" not in err and "AWS_ACCESS_KEY_ID" in err
    missing = object_config(tmp_path, upstream, seaweedfs, "no-such-bucket-here", replica="m")
    status, err = serve_exits(missing, env)
    assert status == 1 and "storage.url" in err and "does not exist" in err, err
    away = object_config(
        tmp_path, upstream, seaweedfs, s3_bucket, "x", endpoint="http://127.0.0.1:9"
    )
    status, err = serve_exits(away, env)
    assert status == 1 and "storage.s3.endpoint" in err and "cannot reach" in err, err
    assert "Traceback" not in err


def test_no_credentials_at_all_stop_the_start_at_once_saying_so(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    clean_env: dict[str, str],
) -> None:
    """No credentials anywhere in the chain is not an unreachable endpoint: it is said
    at once (never retried as if the bucket were down), naming the credentials."""
    env = {k: v for k, v in clean_env.items() if not k.startswith("AWS_")}
    nowhere = tmp_path / "no-aws-files"
    env.update(
        HOME=str(nowhere),
        AWS_CONFIG_FILE=str(nowhere / "config"),
        AWS_SHARED_CREDENTIALS_FILE=str(nowhere / "credentials"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    config = object_config(tmp_path, upstream, seaweedfs, s3_bucket)
    status, err = serve_exits(config, env)
    assert status == 1 and "storage.url" in err and "no AWS credentials" in err, err
    assert "AWS_ACCESS_KEY_ID" in err
    assert "cannot reach" not in err and "retrying" not in err, err
    assert "Traceback" not in err


def test_kill_9_during_the_upload_leaves_no_object_and_no_entry(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    faults: S3Faults,
) -> None:
    body = os.urandom(40 * MiB)  # a multipart upload
    upstream.files[PATH] = body
    endpoint = faults.endpoint  # type: ignore[attr-defined]
    config = object_config(tmp_path, upstream, seaweedfs, s3_bucket, endpoint=endpoint)
    proxy = ProxyProcess(config, tmp_path, "killed", env=seaweedfs.env).start().wait_ready()
    faults.held.add("upload_part")  # the upload starts, and its parts wait
    try:
        got = httpx.get(proxy.url + URL, timeout=60)
        assert got.status_code == 200 and got.content == body  # verified: clients finish
        deadline = time.monotonic() + 30
        while faults.seen["upload_part"] == 0:
            assert time.monotonic() < deadline, "the upload never started"
            time.sleep(0.02)
        proxy.signal(signal.SIGKILL)
        proxy.wait(30)
    finally:
        faults.held.clear()
    time.sleep(0.5)  # a part let through now finds its client gone
    assert blob_key(body) not in seaweedfs.keys(s3_bucket), "no object at the final key"
    assert entries(tmp_path) == []
    assert [k for k in seaweedfs.uploads(s3_bucket) if k == blob_key(body)], "left for reclaim"
    again = ProxyProcess(config, tmp_path, "again", env=seaweedfs.env).start().wait_ready()
    try:
        assert httpx.get(again.url + URL, timeout=60).content == body
        assert httpx.head(again.url + URL, timeout=60).status_code == 200
        stored = seaweedfs.get(s3_bucket, blob_key(body))
        assert hashlib.sha256(stored).hexdigest() == hashlib.sha256(body).hexdigest()
        assert entries(tmp_path) == ["tool-1.0.bin"]
    finally:
        again.stop()


def test_the_console_and_the_api_say_when_the_bucket_is_down(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
) -> None:
    """On object storage the dashboard and /api/v1/stats judged only a folder (and named
    storage.path, which holds no blob there): with the bucket not answering they said
    the storage was fine and the fleet healthy while /readyz said otherwise."""
    admin = '[admin]\n[admin.users.ops]\npassword = "ops-password"\n'
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a", extra=admin)
    auth = ("ops", "ops-password")
    stats = httpx.get(a.url + "/api/v1/stats", auth=auth, timeout=60).json()["storage"]
    assert stats["ok"] and s3_bucket in stats["url"], stats
    assert stats["path"] == str(tmp_path / "local-a"), "the folder checked is the local tier"
    seaweedfs.pause()
    try:
        deadline = time.monotonic() + 60  # the last look at the bucket is kept 5 s
        while (
            stats := httpx.get(a.url + "/api/v1/stats", auth=auth, timeout=60).json()["storage"]
        )["ok"]:
            assert time.monotonic() < deadline, "the stats never said the bucket is down"
            time.sleep(0.5)
        assert "storage:" in stats["error"], stats
        page = httpx.get(a.url + "/ui/", auth=auth, timeout=60).text
        assert "Healthy:" not in page and "object storage" in page, page
    finally:
        seaweedfs.resume()


def test_every_listing_stays_under_the_blobs_prefix(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    start_proxy: ProxyFactory,
    faults: S3Faults,
) -> None:
    """The start-up and readiness check listed the whole bucket (no prefix), although
    nothing else the proxy does lists outside {prefix}blobs/: a bucket policy granting
    s3:ListBucket only for the proxy's prefix stopped every start as 'wrong
    credentials'."""
    endpoint = faults.endpoint  # type: ignore[attr-defined]
    a = start(start_proxy, tmp_path, upstream, seaweedfs, s3_bucket, "a", endpoint=endpoint)
    assert httpx.get(a.url + "/readyz", timeout=60).status_code == 200
    assert faults.lists, "the start checks the bucket"
    for query in faults.lists:
        prefix = parse_qs(query).get("prefix", [""])[0]
        assert prefix == "proxy/blobs/", query

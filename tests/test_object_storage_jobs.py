"""Jobs on object storage (proxy/storage/objects.py, proxy/jobs/; docs/architecture.md,
"Object storage"): the tombstone purge deletes objects in DeleteObjects batches after
the grace, reclaim (and ``proxy gc``) removes objects no entry or tombstone names once
they are a day old and aborts multipart uploads a crash left, the local tier evicts by
itself, and ``proxy storage copy`` moves a folder store into a bucket."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from unittest.mock import AsyncMock

import pytest

from proxy.clock import ManualClock
from proxy.config.load import load
from proxy.engine import Engine, open_engine
from proxy.exceptions import StorageFull
from proxy.storage import s3 as s3_module
from tests.conftest import pypi_config, s3_storage, write_config
from tests.seaweed import SeaweedFS
from tests.test_eviction import add_files, job, pypi_repository, warm_in_order
from tests.test_object_storage import requests
from tests.upstream import FakeUpstream

KB = 1000
DAY_S = 24 * 3600


def key_of(body: bytes) -> str:
    sha = hashlib.sha256(body).hexdigest()
    return f"proxy/blobs/{sha[:2]}/{sha[2:4]}/{sha}"


@asynccontextmanager
async def engine_on_s3(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    bucket: str,
    clock: ManualClock,
    local_max: str = "1GB",
    min_free: str = "1MB",
) -> AsyncIterator[Engine]:
    storage = s3_storage(
        seaweedfs,
        bucket,
        tmp_path / "local",
        storage_extra=f'local_cache_max_size = "{local_max}"\nmin_free = "{min_free}"',
    )
    extra = (
        f'[database]\nurl = "sqlite:///{tmp_path / "catalog.db"}"\n[jobs]\nevict_grace = "10m"\n'
    )
    body = pypi_config(
        tmp_path / "data", upstream.base_url, extra=extra, repo_extra='retention = "1d"'
    )
    # The [storage] table: its path first, then the bucket's keys and [storage.s3].
    body = body.replace(
        f'path = "{tmp_path / "data"}"', f'path = "{tmp_path / "data"}"\n{storage}', 1
    )
    settings = load(write_config(tmp_path, body), {})
    async with open_engine(settings, clock) as engine:
        yield engine


def test_purge_deletes_objects_in_batches_after_the_grace_and_reclaim_removes_leftovers(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files = add_files(upstream, 5, 10 * KB)
    orphan = os.urandom(3000)  # an upload whose entry was never recorded (a crash)
    monkeypatch.setattr(s3_module, "DELETE_BATCH", 2)  # a DeleteObjects per two keys
    clock = ManualClock()

    async def start_upload() -> None:  # a multipart upload a crash left behind
        async with seaweedfs.client() as s3:
            await s3.create_multipart_upload(
                Bucket=s3_bucket, Key="proxy/blobs/ab/cd/abcd" + "e" * 60
            )

    asyncio.run(start_upload())

    async def scenario() -> None:
        async with engine_on_s3(tmp_path, upstream, seaweedfs, s3_bucket, clock) as engine:
            # After the catalog was made: a blob older than it is not its orphan.
            await asyncio.to_thread(seaweedfs.put, s3_bucket, key_of(orphan), orphan)
            await warm_in_order(engine, clock, files)
            stored = set(await asyncio.to_thread(seaweedfs.keys, s3_bucket))
            assert {key_of(f.body) for f in files} <= stored
            summary = await job(engine, "reclaim").run()
            assert "0 orphan blobs" in summary and "0 temp files and unfinished uploads" in summary
            assert len(await asyncio.to_thread(seaweedfs.uploads, s3_bucket)) == 1, (
                "too young to be a crash's"
            )

            clock.advance(2 * DAY_S)  # every entry unused for a day; the leftovers old
            summary = await job(engine, "retention").run()
            assert "6 entries" in summary and "deleted 0 blobs" in summary  # 5 files, 1 page
            summary = await job(engine, "reclaim").run()
            assert "1 orphan blobs" in summary, summary  # the orphan; tombstoned ones wait
            assert "1 temp files and unfinished uploads" in summary, summary
            assert (await asyncio.to_thread(seaweedfs.uploads, s3_bucket)) == []
            assert key_of(orphan) not in (await asyncio.to_thread(seaweedfs.keys, s3_bucket))

            clock.advance(11 * 60)  # past evict_grace
            deletes = requests("delete")
            summary = await job(engine, "evict").run()
            assert "deleted 6 blobs past their grace" in summary, summary
            assert requests("delete") - deletes == 3  # 6 keys, two per request
            assert (await asyncio.to_thread(seaweedfs.keys, s3_bucket)) == {}
            local = tmp_path / "local" / "blobs"
            assert not [p for p in local.rglob("*") if p.is_file()], "the local copies too"

    asyncio.run(scenario())


def test_the_local_tier_evicts_least_recently_used_copies_by_itself(
    tmp_path: Path, upstream: FakeUpstream, seaweedfs: SeaweedFS, s3_bucket: str
) -> None:
    files = add_files(upstream, 6, 10 * KB)
    clock = ManualClock()

    async def scenario() -> None:
        async with engine_on_s3(
            tmp_path, upstream, seaweedfs, s3_bucket, clock, local_max="35KB"
        ) as engine:
            await warm_in_order(engine, clock, files)
            local = {p.name for p in (tmp_path / "local" / "blobs").rglob("*") if p.is_file()}
            assert len(local) <= 3, local  # 35 KB of 10 KB files (and a small page)
            newest = hashlib.sha256(files[-1].body).hexdigest()
            oldest = hashlib.sha256(files[0].body).hexdigest()
            assert newest in local and oldest not in local
            view, adapter = pypi_repository(engine)
            gets = requests("get")
            spec = adapter.file_spec("pkg", files[0].filename)
            assert await view.read(spec, 10**6) == files[0].body  # a cold hit: one GET
            assert requests("get") - gets == 1
            assert await view.read(spec, 10**6) == files[0].body  # now a local copy
            assert requests("get") - gets == 1
            tier = engine.storage.tier  # type: ignore[attr-defined]
            for _ in range(500):  # the fill keeps its copy once the body is verified
                if tier.path(oldest) is not None:
                    break
                await asyncio.sleep(0.01)
            assert tier.path(oldest) is not None
        # A restart rebuilds the order from the folder.
        async with engine_on_s3(
            tmp_path, upstream, seaweedfs, s3_bucket, clock, local_max="35KB"
        ) as engine:
            assert isinstance(engine.storage, type(engine.storage))
            tier = engine.storage.tier  # type: ignore[attr-defined]
            assert 0 < tier.size_bytes <= 35 * KB
            assert oldest in {p.name for p in (tmp_path / "local" / "blobs").rglob("*")}

    asyncio.run(scenario())


def test_under_min_free_the_local_tier_sheds_copies_it_can_refill(
    tmp_path: Path, upstream: FakeUpstream, seaweedfs: SeaweedFS, s3_bucket: str
) -> None:
    """A disk under ``storage.min_free`` (docs/architecture.md, "Storage faults"): the
    local tier gives up its least recently used copies, which the bucket still holds,
    and the miss goes on; when shedding cannot reach the floor, it keeps them and the
    miss is refused."""
    files = add_files(upstream, 6, 10 * KB)
    clock = ManualClock()
    shas = [hashlib.sha256(f.body).hexdigest() for f in files]

    def copies() -> set[str]:
        return {p.name for p in (tmp_path / "local" / "blobs").rglob("*") if p.is_file()}

    async def scenario() -> None:
        async with engine_on_s3(tmp_path, upstream, seaweedfs, s3_bucket, clock) as engine:
            await warm_in_order(engine, clock, files[:4])
            assert set(shas[:4]) <= copies()
            tier = engine.storage.tier  # type: ignore[attr-defined]
            # A 45 KB disk the tier's copies (a page, four files: ~41 KB) share, with a
            # 10 KB floor: a 10 KB miss needs ~16 KB shed, whole copies, oldest first.
            engine.storage.files.free_space = AsyncMock(  # type: ignore[method-assign]
                side_effect=lambda: 45 * KB - tier.size_bytes
            )
            engine.cache.fetcher.min_free = 10 * KB
            view, adapter = pypi_repository(engine)
            spec = adapter.file_spec("pkg", files[4].filename)
            assert await view.read(spec, 10**6) == files[4].body
            assert shas[0] not in copies() and shas[1] not in copies()
            assert {shas[2], shas[3]} <= copies()
        async with engine_on_s3(
            tmp_path, upstream, seaweedfs, s3_bucket, clock, min_free="1000TB"
        ) as engine:
            before = copies()
            view, adapter = pypi_repository(engine)
            spec = adapter.file_spec("pkg", files[5].filename)
            with pytest.raises(StorageFull, match=r"under storage.min_free \(1000TB\)"):
                await view.read(spec, 10**6)
            assert copies() == before  # shedding them all would not reach 1000 TB
            spec = adapter.file_spec("pkg", files[0].filename)
            assert await view.read(spec, 10**6) == files[0].body  # from the bucket again

    asyncio.run(scenario())


def test_storage_copy_moves_a_folder_store_into_a_bucket_and_resumes(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    clean_env: dict[str, str],
) -> None:
    blobs = tmp_path / "data" / "blobs"
    bodies = [os.urandom(n * 1000 + 1) for n in range(1, 6)] + [os.urandom(20 * 2**20)]
    for body in bodies:
        sha = hashlib.sha256(body).hexdigest()
        path = blobs / sha[:2] / sha[2:4] / sha
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    bad = blobs / "ab" / "cd" / ("ab" + "cd" + "0" * 60)
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_bytes(b"not what the name says")
    config = write_config(tmp_path, f'[storage]\npath = "{tmp_path / "data"}"\n')
    seaweedfs.put(s3_bucket, f"moved/{key_of(bodies[0])[len('proxy/') :]}", bodies[0])
    argv = [
        sys.executable, "-m", "proxy", "storage", "copy", "--config", str(config),
        "--to", f"s3://{s3_bucket}/moved/", "--endpoint", seaweedfs.endpoint,
        "--region", "us-east-1", "--path-style",
    ]  # fmt: skip
    env = {**clean_env, **seaweedfs.env}
    first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 1, first.stderr  # the corrupt file is reported
    assert "5 copied" in first.stdout and "1 already there" in first.stdout, first.stdout
    assert "1 corrupt" in first.stdout and "corrupt" in first.stdout
    keys = seaweedfs.keys(s3_bucket, "moved/")
    for body in bodies:
        sha = hashlib.sha256(body).hexdigest()
        key = f"moved/blobs/{sha[:2]}/{sha[2:4]}/{sha}"
        assert keys[key] == len(body)
        assert seaweedfs.get(s3_bucket, key) == body
    assert len(keys) == len(bodies), "the corrupt file was not copied"
    bad.unlink()
    again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "0 copied" in again.stdout and f"{len(bodies)} already there" in again.stdout
    assert f"s3://{s3_bucket}/moved/" in again.stdout and "storage.url" in again.stdout
    wrong = subprocess.run(
        [*argv[:7], "gs://x/", *argv[8:]], capture_output=True, text=True, env=env, timeout=60
    )
    assert wrong.returncode == 2 and "--to" in wrong.stderr


def test_proxy_gc_on_object_storage_lists_the_bucket_and_removes_nothing_young(
    tmp_path: Path,
    upstream: FakeUpstream,
    seaweedfs: SeaweedFS,
    s3_bucket: str,
    clean_env: dict[str, str],
) -> None:
    """`proxy gc` is the reclaim pass, on the bucket: it lists it and aborts or deletes
    only what is a day old (nothing here), and says what it did."""
    orphan = os.urandom(500)
    seaweedfs.put(s3_bucket, key_of(orphan), orphan)
    config = write_config(
        tmp_path,
        f"""
        [database]
        url = "sqlite:///{tmp_path / "catalog.db"}"
        [storage]
        path = "{tmp_path / "data"}"
        {s3_storage(seaweedfs, s3_bucket, tmp_path / "local")}
        """,
    )
    # gc needs the catalog that names the blobs (one made now would name none).
    migrated = subprocess.run(
        [sys.executable, "-m", "proxy", "migrate", "--config", str(config)],
        capture_output=True, text=True, timeout=120, env={**clean_env, **seaweedfs.env},
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "gc", "--config", str(config)],
        capture_output=True, text=True, timeout=120, env={**clean_env, **seaweedfs.env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "0 orphan blobs" in done.stdout and "unfinished uploads" in done.stdout
    assert key_of(orphan) in seaweedfs.keys(s3_bucket)  # younger than a day
    wrong = subprocess.run(
        [sys.executable, "-m", "proxy", "gc", "--config", str(config)],
        capture_output=True, text=True, timeout=120,
        env={**clean_env, **seaweedfs.env, "AWS_SECRET_ACCESS_KEY": "wrong"},
    )  # fmt: skip
    assert wrong.returncode == 1 and "access denied" in wrong.stderr, wrong.stderr
    assert "Traceback" not in wrong.stderr


def test_reclaim_aborts_only_the_proxys_own_unfinished_uploads(
    tmp_path: Path, upstream: FakeUpstream, seaweedfs: SeaweedFS, s3_bucket: str
) -> None:
    """The reclaim job aborted every multipart upload under the prefix that was a day
    old, also another writer's beside the blobs (a backup streamed into the same bucket
    and prefix), while orphan removal touches only keys of the blobs' own form."""
    clock = ManualClock()
    ours = "proxy/blobs/ab/cd/abcd" + "e" * 60
    others = ["proxy/exports/backup.tar", "proxy/blobs/not-a-blob", "proxy/blobsy/x"]

    async def start_uploads() -> None:
        async with seaweedfs.client() as s3:
            for key in [ours, *others]:
                await s3.create_multipart_upload(Bucket=s3_bucket, Key=key)

    asyncio.run(start_uploads())

    async def scenario() -> None:
        async with engine_on_s3(tmp_path, upstream, seaweedfs, s3_bucket, clock) as engine:
            clock.advance(2 * DAY_S)
            summary = await job(engine, "reclaim").run()
            assert "1 temp files and unfinished uploads" in summary, summary
            left = await asyncio.to_thread(seaweedfs.uploads, s3_bucket)
            assert sorted(left) == sorted(others)

    asyncio.run(scenario())


def test_storage_copy_skips_a_fifo_or_a_link_at_a_blobs_name_and_finishes(
    tmp_path: Path, seaweedfs: SeaweedFS, s3_bucket: str, clean_env: dict[str, str]
) -> None:
    """A FIFO at a blob's name hung the copy for ever (its open waits for a writer, in
    an I/O thread); a symlink was followed out of the store. Like the local tier, the
    copy reads only regular files of their own, and says which it could not."""
    blobs = tmp_path / "data" / "blobs"
    body = os.urandom(3000)
    sha = hashlib.sha256(body).hexdigest()
    outside = tmp_path / "outside"
    outside.write_bytes(body)  # the right bytes, but not the store's file
    for name, make in (
        (sha, lambda p: p.symlink_to(outside)),
        ("ef" + "01" + "2" * 60, lambda p: os.mkfifo(p)),
    ):
        path = blobs / name[:2] / name[2:4] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        make(path)
    good = os.urandom(2000)
    good_sha = hashlib.sha256(good).hexdigest()
    path = blobs / good_sha[:2] / good_sha[2:4] / good_sha
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(good)
    config = write_config(tmp_path, f'[storage]\npath = "{tmp_path / "data"}"\n')
    argv = [
        sys.executable, "-m", "proxy", "storage", "copy", "--config", str(config),
        "--to", f"s3://{s3_bucket}/moved/", "--endpoint", seaweedfs.endpoint,
        "--region", "us-east-1", "--path-style",
    ]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**clean_env, **seaweedfs.env}, timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert "1 copied" in done.stdout and "2 failed" in done.stdout, done.stdout
    assert "not a regular file" in done.stdout, done.stdout
    keys = seaweedfs.keys(s3_bucket, "moved/")
    assert list(keys) == [f"moved/blobs/{good_sha[:2]}/{good_sha[2:4]}/{good_sha}"]

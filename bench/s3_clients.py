"""aiobotocore (through the proxy's own bucket client, proxy/storage/s3.py) against
obstore, on the proxy's two paths to a bucket (docs/architecture.md, "Object storage"):

- the hit path: cold GETs streamed (one 64 MiB object; 200 objects of 10 KiB one after
  the other, and 16 at a time);
- the miss path: uploads from a file (1 MiB x 20; 1 GiB, multipart of 16 MiB parts, four
  in flight).

    .venv/bin/python -m bench.s3_clients [--gib 1]

Starts a SeaweedFS of its own (tests/seaweed.py) on loopback. Figures depend on the
server as much as on the client: the same server serves both, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import make_file, workdir
from proxy.config.settings import ObjectStorageSettings
from proxy.storage.s3 import Bucket
from tests.seaweed import ACCESS_KEY, REGION, SECRET_KEY, SeaweedFS

MB = 10**6
MiB = 2**20
PART = 16 * MiB
SMALL = 10 * 1024


def load() -> str:
    return os.getloadavg().__repr__()


async def aiobotocore_figures(
    seaweed: SeaweedFS, bucket: str, files: dict[str, Path]
) -> dict[str, float]:
    settings = ObjectStorageSettings(
        bucket=bucket, prefix="aio/", local_cache=Path("/nonexistent"),
        endpoint=seaweed.endpoint, region=REGION, path_style=True,
    )  # fmt: skip
    client = Bucket(settings)
    await client.open()
    out: dict[str, float] = {}
    try:
        names = {}
        for label, path in files.items():
            sha = label.ljust(64, "0")
            names[label] = sha
            fd = os.open(path, os.O_RDONLY)
            try:
                size = path.stat().st_size
                if label == "1MiB":
                    times = []
                    for _ in range(20):
                        started = time.perf_counter()
                        await client.put_file(sha, fd, size)
                        times.append(time.perf_counter() - started)
                    out["upload 1 MiB, ms (median of 20)"] = statistics.median(times) * 1000
                elif label == "big":
                    started = time.perf_counter()
                    await client.put_file(sha, fd, size)
                    out["upload big, MB/s"] = size / (time.perf_counter() - started) / MB
                else:
                    await client.put_file(sha, fd, size)
            finally:
                os.close(fd)

        async def stream(sha: str) -> int:
            got = 0
            answer = await client.get(sha)
            try:
                async for chunk in answer.chunks():
                    got += len(chunk)
            finally:
                answer.close()
            return got

        started = time.perf_counter()
        size = await stream(names["64MiB"])
        out["cold GET 64 MiB streamed, MB/s"] = size / (time.perf_counter() - started) / MB
        small = [f"small{i}".ljust(64, "0") for i in range(200)]
        body_fd = os.open(files["10KiB"], os.O_RDONLY)
        try:
            for sha in small:
                await client.put_file(sha, body_fd, SMALL)
        finally:
            os.close(body_fd)
        started = time.perf_counter()
        for sha in small:
            await stream(sha)
        out["cold GETs of 10 KiB one at a time, /s"] = len(small) / (time.perf_counter() - started)
        started = time.perf_counter()
        slots = asyncio.Semaphore(16)

        async def limited(sha: str) -> None:
            async with slots:
                await stream(sha)

        await asyncio.gather(*(limited(sha) for sha in small))
        out["cold GETs of 10 KiB, 16 at a time, /s"] = len(small) / (time.perf_counter() - started)
    finally:
        await client.close()
    return out


async def obstore_figures(
    seaweed: SeaweedFS, bucket: str, files: dict[str, Path]
) -> dict[str, float]:
    import obstore
    from obstore.store import S3Store

    store: Any = S3Store(
        bucket, endpoint=seaweed.endpoint, region=REGION, access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY, virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )  # fmt: skip
    out: dict[str, float] = {}
    for label, path in files.items():
        key = f"ob/{label}"
        if label == "1MiB":
            times = []
            for _ in range(20):
                started = time.perf_counter()
                await obstore.put_async(store, key, path, chunk_size=PART, max_concurrency=4)
                times.append(time.perf_counter() - started)
            out["upload 1 MiB, ms (median of 20)"] = statistics.median(times) * 1000
        elif label == "big":
            started = time.perf_counter()
            await obstore.put_async(store, key, path, chunk_size=PART, max_concurrency=4)
            out["upload big, MB/s"] = path.stat().st_size / (time.perf_counter() - started) / MB
        else:
            await obstore.put_async(store, key, path)

    async def stream(key: str) -> int:
        got = 0
        answer = await obstore.get_async(store, key)
        async for chunk in answer.stream(MiB):
            got += len(chunk)
        return got

    started = time.perf_counter()
    size = await stream("ob/64MiB")
    out["cold GET 64 MiB streamed, MB/s"] = size / (time.perf_counter() - started) / MB
    small = [f"ob/small{i}" for i in range(200)]
    body = files["10KiB"].read_bytes()
    for key in small:
        await obstore.put_async(store, key, body)
    started = time.perf_counter()
    for key in small:
        await stream(key)
    out["cold GETs of 10 KiB one at a time, /s"] = len(small) / (time.perf_counter() - started)
    slots = asyncio.Semaphore(16)

    async def limited(key: str) -> None:
        async with slots:
            await stream(key)

    started = time.perf_counter()
    await asyncio.gather(*(limited(key) for key in small))
    out["cold GETs of 10 KiB, 16 at a time, /s"] = len(small) / (time.perf_counter() - started)
    return out


async def run(args: argparse.Namespace) -> None:
    work = workdir("s3-clients")
    seaweed = await asyncio.to_thread(lambda: SeaweedFS().start())
    for name, value in seaweed.env.items():
        os.environ[name] = value
    try:
        files = {
            "10KiB": make_file(work / "10KiB", SMALL),
            "1MiB": make_file(work / "1MiB", MiB),
            "64MiB": make_file(work / "64MiB", 64 * MiB),
            "big": make_file(work / "big", int(args.gib * 2**30)),
        }
        print(f"SeaweedFS on loopback; load before: {load()}; big = {args.gib} GiB")
        results = {}
        for name, measure in (("aiobotocore", aiobotocore_figures), ("obstore", obstore_figures)):
            bucket = await asyncio.to_thread(seaweed.new_bucket)
            results[name] = await measure(seaweed, bucket, files)
            print(f"  {name} done; load {load()}")
        rows = list(results["aiobotocore"])
        width = max(len(r) for r in rows)
        print(f"{'':<{width}}  {'aiobotocore':>12}  {'obstore':>12}")
        for row in rows:
            print(
                f"{row:<{width}}  {results['aiobotocore'][row]:>12.1f}  {results['obstore'][row]:>12.1f}"
            )
    finally:
        await asyncio.to_thread(seaweed.destroy)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the big upload, GiB")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()

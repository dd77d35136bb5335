"""Eviction and retention passes over a catalog of a million entries, on SQLite and on
Postgres, with hits and access flushes running beside them in another process.

    .venv/bin/python -m bench.evict [--entries 1000000] [--backend sqlite|postgres|both]
                                    [--per-blob-sweep] [--no-sweep]

The catalog is filled through SQL directly (no HTTP): proxied entries of four
repositories with sizes of 1 KB to 1 MB and last accesses spread over 200 days. Then:
the storage total (one aggregate), one eviction pass removing a 10% overshoot (down to
the 90% low watermark), one retention pass ("120d" on two repositories), and the purge
of the tombstones the two passes left. Then reclaim's orphan sweep over one blob file per
original entry (a million files; the evicted and expired ones are orphans by then),
asking the catalog once per batch of names; ``--per-blob-sweep`` asks once per blob
instead, as the sweep did before, for comparison. Meanwhile a second process (another
worker or replica) looks entries up in the catalog every 5 ms and flushes 5,000 access
times every second; their latencies are printed for the quiet baseline and during the
passes.
Postgres is started like the tests do (tests/pg.py). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import percentile, workdir
from proxy.catalog import migrations_dir, open_catalog
from proxy.clock import SYSTEM_CLOCK
from proxy.config.load import load

DAY_MS = 86_400_000
REPOSITORIES = ("pypi", "maven", "npm-raw", "tools")
FILL_CHUNK = 50_000


def rows(count: int, now_ms: int) -> Iterator[tuple[Any, ...]]:
    rng = random.Random(42)
    for i in range(count):
        repo = REPOSITORIES[i % len(REPOSITORIES)]
        kind = "metadata" if i % 10 == 0 else "immutable"
        size = int(rng.paretovariate(1.2) * 1000) % 1_000_000 + 1000
        accessed = now_ms - rng.randrange(200 * DAY_MS)
        sha = f"{i:064x}"
        yield (repo, f"files/p{i % 50_000}/f{i}.tar.gz", kind, sha, size, None, None, None,
               "{}", accessed, None, accessed)  # fmt: skip


def fill_sqlite(path: Path, count: int) -> None:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO entries (repository, key, kind, sha256, size, content_type, etag, "
        "last_modified, digests, fetched_at_ms, expires_at_ms, last_access_ms) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        rows(count, SYSTEM_CLOCK.now_ms()),
    )
    conn.execute("COMMIT")
    conn.execute("ANALYZE")
    conn.close()


async def fill_postgres(url: str, count: int) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        columns = ["repository", "key", "kind", "sha256", "size", "content_type", "etag",
                   "last_modified", "digests", "fetched_at_ms", "expires_at_ms", "last_access_ms"]  # fmt: skip
        batch: list[tuple[Any, ...]] = []
        for row in rows(count, SYSTEM_CLOCK.now_ms()):
            batch.append(row)
            if len(batch) == FILL_CHUNK:
                await conn.copy_records_to_table("entries", records=batch, columns=columns)
                batch = []
        if batch:
            await conn.copy_records_to_table("entries", records=batch, columns=columns)
        await conn.execute("VACUUM ANALYZE entries")
    finally:
        await conn.close()


# -- the load beside the pass: another worker or replica -----------------------------------


def load_process(database_url: str, count: int, stop: Any, out: str) -> None:
    samples = asyncio.run(_load(database_url, count, stop))
    Path(out).write_text(json.dumps(samples))


def read_samples(out: str) -> list[list[Any]]:
    samples: list[list[Any]] = json.loads(Path(out).read_text())
    return samples


async def _load(database_url: str, count: int, stop: Any) -> list[tuple[float, str, float]]:
    catalog = open_catalog(database_url, SYSTEM_CLOCK)
    rng = random.Random(7)
    samples: list[tuple[float, str, float]] = []
    next_flush = time.time() + 1
    try:
        while not stop.is_set():
            i = rng.randrange(count)
            repo = REPOSITORIES[i % len(REPOSITORIES)]
            started = time.perf_counter()
            await catalog.get_entry(repo, f"files/p{i % 50_000}/f{i}.tar.gz")
            samples.append((time.time(), "lookup", time.perf_counter() - started))
            if time.time() >= next_flush:
                now = SYSTEM_CLOCK.now_ms()
                batch = []
                for _ in range(5000):
                    j = rng.randrange(count)
                    batch.append((REPOSITORIES[j % 4], f"files/p{j % 50_000}/f{j}.tar.gz", now))
                started = time.perf_counter()
                await catalog.touch_entries(batch)
                samples.append((time.time(), "flush", time.perf_counter() - started))
                next_flush = time.time() + 1
            await asyncio.sleep(0.005)
    finally:
        await catalog.close()
    return samples


def latencies(samples: list[list[Any]], kind: str, start: float, end: float) -> str:
    values = [s[2] * 1000 for s in samples if s[1] == kind and start <= s[0] <= end]
    if not values:
        return "no samples"
    return (
        f"p50 {percentile(values, 50):.1f} ms, p99 {percentile(values, 99):.1f} ms, "
        f"max {max(values):.1f} ms ({len(values)} samples)"
    )


# -- one backend --------------------------------------------------------------------------


def make_blob_files(blobs_dir: Path, count: int) -> None:
    """One empty file per entry of ``rows`` (named by its sha256), a day old."""
    old_s = time.time() - 86_400
    made: set[Path] = set()
    for i in range(count):
        sha = f"{i:064x}"
        folder = blobs_dir / sha[:2] / sha[2:4]
        if folder not in made:
            folder.mkdir(parents=True, exist_ok=True)
            made.add(folder)
        path = folder / sha
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        os.utime(path, (old_s, old_s))


async def sweep(engine: Any, count: int, per_blob: bool) -> tuple[float, int, int]:
    """Reclaim's orphan sweep; (seconds, catalog questions, blobs deleted)."""
    from proxy.clock import SYSTEM_CLOCK as clock
    from proxy.jobs import reclaim
    from proxy.runtime.blocking import run_blocking
    from proxy.storage import blobs

    started = time.perf_counter()
    await run_blocking(make_blob_files, engine.blobs.blobs_dir, count)
    print(f"  {count:,} blob files made in {time.perf_counter() - started:.0f} s")
    if per_blob:
        blobs.CANDIDATE_BATCH = 1  # the sweep before issue 21: one question per blob
    questions = 0
    ask = engine.catalog.unreferenced_blobs

    async def counting(names: list[str]) -> set[str]:
        nonlocal questions
        questions += 1
        found: set[str] = await ask(names)
        return found

    engine.catalog.unreferenced_blobs = counting
    job = reclaim.Reclaim(engine.catalog, engine.storage, clock, 86_400)
    started = time.perf_counter()
    removed = await job.remove_orphans()
    return time.perf_counter() - started, questions, removed


async def measure(
    database_url: str, work: Path, count: int, sweep_blobs: bool = True, per_blob: bool = False
) -> None:
    from proxy.engine import open_engine

    config = work / "bench.toml"
    repos = "".join(
        f'[[repositories]]\nname = "{r}"\nformat = "raw"\nupstream = "http://127.0.0.1:9/"\n'
        + ('retention = "120d"\n' if r in ("pypi", "maven") else "")
        for r in REPOSITORIES
    )
    catalog = open_catalog(database_url, SYSTEM_CLOCK)
    usage_started = time.perf_counter()
    usage = await catalog.storage_usage()
    usage_s = time.perf_counter() - usage_started
    await catalog.close()
    max_size = int(usage.proxied_bytes / 1.1)  # a 10% overshoot
    config.write_text(
        f'[database]\nurl = "{database_url}"\n[storage]\npath = "{work / "data"}"\n'
        f'max_size = {max_size}\nlow_watermark = "90%"\n[jobs]\nevict_grace = "0"\n{repos}'
    )
    settings = load(config, {})
    print(f"  entries: {usage.proxied_entries:,}, {usage.proxied_bytes / 1e9:.1f} GB proxied")
    print(f"  storage total (one aggregate): {usage_s * 1000:.0f} ms")

    out = str(work / "load.json")
    baseline_s = 3.0
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    loader = spawn.Process(target=load_process, args=(database_url, count, stop, out))
    loader.start()
    await asyncio.sleep(baseline_s + 1)  # the loader's start-up, then a quiet baseline
    async with open_engine(settings, SYSTEM_CLOCK) as engine:
        from proxy.jobs.evict import Eviction
        from proxy.jobs.retention import Retention

        # The two passes keep their tombstones (a long grace), so the purge is timed alone.
        eviction = Eviction(max_size, 0.9, 10**9, engine.cache)
        t0 = time.time()
        summary = await eviction.run()
        t1 = time.time()
        print(f"  eviction pass: {t1 - t0:.2f} s  ({summary.split(';')[0]})")
        keep = {r.name: r.retention_s for r in settings.repositories if r.retention_s is not None}
        summary = await Retention(keep, 10**9, engine.cache, SYSTEM_CLOCK).run()
        t2 = time.time()
        print(f"  retention pass: {t2 - t1:.2f} s  ({summary.split('; deleted')[0]})")
        tombstoned = (await engine.catalog.storage_usage()).tombstoned_bytes
        purged = await engine.cache.purge_tombstones(0)
        t3 = time.time()
        print(
            f"  tombstone purge: {t3 - t2:.2f} s  ({tombstoned / 1e9:.1f} GB of tombstones; "
            f"{purged.blobs} files deleted: the bench has no blob files)"
        )
        t4 = t5 = t3
        if sweep_blobs:
            seconds, questions, removed = await sweep(engine, count, per_blob)
            t5 = time.time()
            t4 = t5 - seconds
            how = "one question per blob" if per_blob else "one question per batch"
            print(
                f"  orphan sweep ({how}): {seconds:.1f} s over {count:,} blob files, "
                f"{questions:,} catalog questions, {removed:,} orphans deleted"
            )
    stop.set()
    loader.join(timeout=60)
    samples = read_samples(out)
    begin = t0 - baseline_s
    print(f"  other process, quiet: lookups {latencies(samples, 'lookup', begin, t0)}")
    print(f"                        access flushes {latencies(samples, 'flush', begin, t0)}")
    print(f"  during the passes:    lookups {latencies(samples, 'lookup', t0, t3)}")
    print(f"                        access flushes {latencies(samples, 'flush', t0, t3)}")
    if sweep_blobs:
        print(f"  during the sweep:     lookups {latencies(samples, 'lookup', t4, t5)}")


def run_sqlite(count: int, sweep_blobs: bool, per_blob: bool) -> None:
    work = workdir("evict-sqlite")
    db = work / "proxy.db"
    url = f"sqlite:///{db}"

    async def migrate() -> None:
        catalog = open_catalog(url, SYSTEM_CLOCK, migrations_dir())
        await catalog.migrate()
        await catalog.close()

    asyncio.run(migrate())
    started = time.perf_counter()
    fill_sqlite(db, count)
    print(f"SQLite ({sqlite3.sqlite_version}): filled in {time.perf_counter() - started:.0f} s")
    asyncio.run(measure(url, work, count, sweep_blobs, per_blob))


def run_postgres(count: int, sweep_blobs: bool, per_blob: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.pg import PostgresServer, create_database

    server = PostgresServer().init().start()
    try:
        url = create_database(server.admin_url)
        work = workdir("evict-postgres")

        async def migrate() -> None:
            catalog = open_catalog(url, SYSTEM_CLOCK)
            await catalog.migrate()
            await catalog.close()

        asyncio.run(migrate())
        started = time.perf_counter()
        asyncio.run(fill_postgres(url, count))
        print(f"Postgres: filled in {time.perf_counter() - started:.0f} s")
        asyncio.run(measure(url, work, count, sweep_blobs, per_blob))
    finally:
        server.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--batch", type=int, help="entries per delete (default: the jobs')")
    parser.add_argument("--no-sweep", action="store_true", help="skip the orphan sweep")
    parser.add_argument(
        "--per-blob-sweep", action="store_true", help="one catalog question per blob (before)"
    )
    args = parser.parse_args()
    if args.batch:
        from proxy.jobs import evict, retention

        evict.BATCH_ENTRIES = retention.BATCH_ENTRIES = args.batch
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if args.backend in ("sqlite", "both"):
        run_sqlite(args.entries, not args.no_sweep, args.per_blob_sweep)
    if args.backend in ("postgres", "both"):
        run_postgres(args.entries, not args.no_sweep, args.per_blob_sweep)


if __name__ == "__main__":
    main()

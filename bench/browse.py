"""Browsing and purging a catalog of a million entries (docs/architecture.md,
"Operating: console, API and logs"): the keyset pages the console and the admin API
serve (first, middle and last page; a package-name search; the package listing; one
package; a purge), and beside them what an OFFSET page at the same depth would cost.

    .venv/bin/python -m bench.browse [--entries 1000000] [--backend sqlite|postgres|both]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import workdir
from proxy.catalog import Catalog, open_catalog, sqlite_path

PAGE = 50
COLUMNS = ["repository", "key", "kind", "sha256", "size", "fetched_at_ms", "last_access_ms",
           "package", "version"]  # fmt: skip
REPEAT = 20


def rows(count: int, packages: int) -> Iterator[tuple[Any, ...]]:
    for i in range(count):
        package = f"project-{i % packages:06d}"
        version = f"{i // packages}.0"
        yield ("pypi", f"files/{package}/{package}-{version}.tar.gz", "immutable",
               f"{i:064x}", 1000 + i % 9973, i, i, package, version)  # fmt: skip


def fill_sqlite(url: str, count: int, packages: int) -> None:
    conn = sqlite3.connect(sqlite_path(url))
    conn.create_function("clock_ms", 0, lambda: 0)
    with conn:
        conn.executemany(
            f"INSERT INTO entries ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
            rows(count, packages),
        )
    conn.execute("ANALYZE")
    conn.close()


async def fill_postgres(url: str, count: int, packages: int) -> None:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        batch: list[tuple[Any, ...]] = []
        for row in rows(count, packages):
            batch.append(row)
            if len(batch) == 50_000:
                await conn.copy_records_to_table("entries", records=batch, columns=COLUMNS)
                batch = []
        if batch:
            await conn.copy_records_to_table("entries", records=batch, columns=COLUMNS)
        await conn.execute("VACUUM ANALYZE entries")
    finally:
        await conn.close()


async def timed(work: Callable[[], Awaitable[Any]]) -> str:
    samples = []
    for _ in range(REPEAT):
        started = time.perf_counter()
        await work()
        samples.append((time.perf_counter() - started) * 1000)
    return f"p50 {statistics.median(samples):7.2f} ms  max {max(samples):7.2f} ms"


async def offset_page(catalog: Catalog, url: str, offset: int) -> None:
    """What a page at the same depth costs with OFFSET (for comparison only)."""
    sql = "SELECT key FROM entries WHERE repository = {0} ORDER BY key LIMIT {1} OFFSET {2}"
    if catalog.backend == "sqlite":
        conn = sqlite3.connect(sqlite_path(url))
        try:
            conn.execute(sql.format("?", "?", "?"), ("pypi", PAGE, offset)).fetchall()
        finally:
            conn.close()
        return
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.fetch(sql.format("$1", "$2", "$3"), "pypi", PAGE, offset)
    finally:
        await conn.close()


async def measure(url: str, count: int, packages: int) -> None:
    catalog = open_catalog(url)
    try:
        middle = f"files/project-{packages // 2:06d}/"
        last = f"files/project-{packages - 1:06d}/"
        print(
            f"  first page of {PAGE}:        {await timed(lambda: catalog.browse_entries('pypi', '', PAGE))}"
        )
        print(
            f"  middle page:              {await timed(lambda: catalog.browse_entries('pypi', middle, PAGE))}"
        )
        print(
            f"  last page:                {await timed(lambda: catalog.browse_entries('pypi', last, PAGE))}"
        )
        print(
            f"  OFFSET page, middle:      {await timed(lambda: offset_page(catalog, url, count // 2))}  (not used: for comparison)"
        )
        prefix = f"project-{packages // 3:06d}"[:-2]
        print(
            f"  search '{prefix}':       {await timed(lambda: catalog.search_entries('pypi', prefix, (prefix, ''), PAGE))}"
        )
        print(
            f"  packages, middle page:    {await timed(lambda: catalog.list_packages('pypi', '', f'project-{packages // 2:06d}', PAGE))}"
        )
        print(
            f"  one package's entries:    {await timed(lambda: catalog.package_entries('pypi', f'project-{packages // 4:06d}', 2000))}"
        )
        started = time.perf_counter()
        removed = await catalog.delete_package("pypi", f"project-{packages // 5:06d}")
        print(
            f"  purge a package ({len(removed)} entries): {(time.perf_counter() - started) * 1000:.2f} ms"
        )
    finally:
        await catalog.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--packages", type=int, default=100_000)
    parser.add_argument("--backend", choices=["sqlite", "postgres", "both"], default="both")
    args = parser.parse_args()
    if args.backend in ("sqlite", "both"):
        url = f"sqlite:///{workdir('browse-sqlite') / 'proxy.db'}"
        asyncio.run(_migrate(url))
        started = time.perf_counter()
        fill_sqlite(url, args.entries, args.packages)
        print(f"SQLite ({sqlite3.sqlite_version}), {args.entries} entries in {args.packages} "
              f"packages, filled in {time.perf_counter() - started:.0f} s")  # fmt: skip
        asyncio.run(measure(url, args.entries, args.packages))
    if args.backend in ("postgres", "both"):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.pg import PostgresServer, create_database

        server = PostgresServer().init().start()
        try:
            url = create_database(server.admin_url)
            asyncio.run(_migrate(url))
            started = time.perf_counter()
            asyncio.run(fill_postgres(url, args.entries, args.packages))
            print(
                f"Postgres, {args.entries} entries, filled in {time.perf_counter() - started:.0f} s"
            )
            asyncio.run(measure(url, args.entries, args.packages))
        finally:
            server.destroy()


async def _migrate(url: str) -> None:
    catalog = open_catalog(url)
    await catalog.migrate()
    await catalog.close()


if __name__ == "__main__":
    main()

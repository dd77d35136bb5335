"""Browsing a large catalog (docs/architecture.md, "Operating: console, API and
logs"): every page, search, package listing and purge is an index range on both
dialects, never a scan of the entries, and keyset pages walk the whole catalog once,
in order. (The figures on a million entries: bench/browse.py.)"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from proxy.catalog import Catalog, Entry, open_catalog, sqlite_path
from proxy.catalog.queries import load as load_queries
from proxy.types import Kind

ENTRIES = 60_000
PACKAGES = 3_000
COLUMNS = ["repository", "key", "kind", "sha256", "size", "fetched_at_ms", "last_access_ms",
           "package", "version"]  # fmt: skip


def rows(count: int) -> Iterator[tuple[Any, ...]]:
    for i in range(count):
        repo = ("pypi", "maven")[i % 2]
        package = f"pkg{i % PACKAGES:05d}"
        version = f"{i // PACKAGES}.0"
        yield (repo, f"files/{package}/{package}-{version}.tar.gz", "immutable",
               f"{i:064x}", 1000 + i % 977, i, i, package, version)  # fmt: skip


async def fill(
    catalog: Catalog, database_url: str, records: list[tuple[Any, ...]] | None = None
) -> None:
    records = list(rows(ENTRIES)) if records is None else records
    if catalog.backend == "memory":
        for r in records:
            await catalog.put_entry(Entry(
                repository=r[0], key=r[1], kind=Kind(r[2]), sha256=r[3], size=r[4],
                content_type=None, fetched_at_ms=r[5], expires_at_ms=None,
                last_access_ms=r[6], package=r[7], version=r[8],
            ))  # fmt: skip
        return
    if catalog.backend == "sqlite":
        conn = sqlite3.connect(sqlite_path(database_url))
        conn.create_function("clock_ms", 0, lambda: 0)
        with conn:
            conn.executemany(
                f"INSERT INTO entries ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                records,
            )
        conn.execute("ANALYZE")
        conn.close()
        return
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        await conn.copy_records_to_table("entries", records=records, columns=COLUMNS)
        await conn.execute("ANALYZE entries")
    finally:
        await conn.close()


async def plan(catalog: Catalog, database_url: str, name: str, *args: Any) -> str:
    statement = load_queries(catalog.backend)[name]
    if catalog.backend == "sqlite":
        conn = sqlite3.connect(sqlite_path(database_url))
        conn.create_function("clock_ms", 0, lambda: 0)
        try:
            found = conn.execute(f"EXPLAIN QUERY PLAN {statement}", args).fetchall()
        finally:
            conn.close()
        return "\n".join(str(row[-1]) for row in found)
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():  # a DELETE is explained, never run
            found = await conn.fetch(f"EXPLAIN {statement}", *args)
            raise _Rollback(found)
    except _Rollback as done:
        return "\n".join(r[0] for r in done.rows)
    finally:
        await conn.close()


class _Rollback(Exception):
    def __init__(self, rows: Any) -> None:
        self.rows = rows


def no_scan(catalog: Catalog, text: str) -> bool:
    if catalog.backend == "sqlite":
        return all(
            "USING" in line for line in text.splitlines() if line.startswith(("SCAN", "SEARCH"))
        ) and "SCAN entries" not in text.replace("SCAN entries USING", "")
    return "Seq Scan on entries" not in text and "Index" in text


@pytest.fixture
async def sql_catalog(database_url: str) -> AsyncIterator[Catalog]:
    """SQLite and Postgres only: the plans are the databases'."""
    opened = open_catalog(database_url)
    await opened.migrate()
    yield opened
    await opened.close()


@pytest.mark.anyio
async def test_pages_searches_and_purges_use_indexes(
    sql_catalog: Catalog, database_url: str
) -> None:
    catalog = sql_catalog
    await fill(catalog, database_url)
    statements: list[tuple[Any, ...]] = [
        ("browse_entries", "pypi", "files/pkg01500/", 51),
        ("search_entries", "pypi", "pkg02", "pkg02", "", 51),
        ("search_entries", "pypi", "pkg02", "pkg02500", "files/pkg02500/x", 51),
        ("list_packages", "pypi", "", "pkg01000", 51),
        ("list_packages", "pypi", "pkg01", "", 51),
        ("package_entries", "pypi", "pkg00042", 2000),
        ("delete_package", "pypi", "pkg00042"),
    ]
    for name, *args in statements:
        text = await plan(catalog, database_url, name, *args)
        assert no_scan(catalog, text), f"{catalog.backend} {name}:\n{text}"


@pytest.mark.anyio
async def test_keyset_pages_walk_the_whole_catalog_once(
    catalog: Catalog, catalog_backend: str
) -> None:
    await fill(catalog, catalog_backend)
    keys: list[str] = []
    after = ""
    while True:
        page = await catalog.browse_entries("maven", after, 5000)
        if not page:
            break
        keys += [e.key for e in page]
        after = page[-1].key
    assert len(keys) == ENTRIES // 2 and keys == sorted(keys) and len(set(keys)) == len(keys)
    # Searching by package prefix, in (package, key) order, page after page.
    found: list[tuple[str, str]] = []
    cursor = ("pkg001", "")
    while True:
        page = await catalog.search_entries("pypi", "pkg001", cursor, 700)
        if not page:
            break
        found += [(e.package or "", e.key) for e in page]
        cursor = found[-1]
    assert len(found) == 100 * (ENTRIES // PACKAGES) // 2  # pkg00100..pkg00199, pypi's half
    assert found == sorted(found) and all(p.startswith("pkg001") for p, _ in found)
    packages = await catalog.list_packages("pypi", "", "pkg02990", 100)
    assert [p.package for p in packages] == [f"pkg{i:05d}" for i in range(2992, 3000, 2)]
    assert (
        packages[0].versions == ENTRIES // PACKAGES and packages[0].entries == ENTRIES // PACKAGES
    )
    removed = await catalog.delete_package("pypi", "pkg00042")
    assert len(removed) == ENTRIES // PACKAGES
    assert await catalog.package_entries("pypi", "pkg00042", 10) == []
    assert (await catalog.purges_after(0))[-1].package == "pkg00042"


@pytest.mark.anyio
async def test_entries_stored_before_packages_were_recorded_get_theirs(
    catalog: Catalog, catalog_backend: str
) -> None:
    from proxy.formats.pypi import package_of
    from proxy.jobs.packages import BATCH_ENTRIES, PackageBackfill

    old = [
        (
            "pypi",
            f"files/proj{i}/proj{i}-{i % 3}.0.tar.gz",
            "immutable",
            f"{i:064x}",
            10,
            i,
            i,
            None,
            None,
        )
        for i in range(BATCH_ENTRIES + 5)
    ] + [("pypi", "simple/#json", "metadata", "f" * 64, 10, 1, 1, None, None)]
    await fill(catalog, catalog_backend, old)
    backfill = PackageBackfill(catalog, {"pypi": package_of})
    assert await backfill.run() == f"gave {BATCH_ENTRIES + 5} entries their package"
    entries = await catalog.package_entries("pypi", "proj7", 10)
    assert [(e.package, e.version) for e in entries] == [("proj7", "1.0")]
    assert len(await catalog.delete_package("pypi", "proj1004")) == 1
    assert await backfill.run() == "gave 0 entries their package"  # done: remembered
    assert await catalog.unpackaged_entries("pypi", "", 10) == ["simple/#json"]

"""In-memory knowledge of entries, so a cache hit costs no database round trip.

``EntryIndex`` remembers entries this process has looked up or stored. Immutable
entries never change, so a remembered one is served as is (if another replica evicted
its blob, opening the file fails and the caller forgets it). Metadata and negative
entries are served only while fresh; hosted entries (writable by any replica) are
never remembered. ``AccessLog`` buffers last-access times and writes them in batches.
"""

from __future__ import annotations

import logging

from proxy.catalog import Catalog, Entry
from proxy.clock import Clock
from proxy.exceptions import CatalogError
from proxy.runtime import metrics
from proxy.types import Kind

log = logging.getLogger("proxy.cache")

INDEX_MAX_ENTRIES = 200_000
ACCESS_FLUSH_BATCH = 5_000


class EntryIndex:
    def __init__(self, max_entries: int = INDEX_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: dict[tuple[str, str], Entry] = {}

    def get(self, repository: str, key: str) -> Entry | None:
        return self._entries.get((repository, key))

    def put(self, entry: Entry) -> None:
        if entry.kind is Kind.HOSTED:
            return
        entries = self._entries
        ident = (entry.repository, entry.key)
        if ident not in entries and len(entries) >= self.max_entries:
            # Forget the oldest insertion: cheap, and a forgotten entry costs one lookup.
            del entries[next(iter(entries))]
        entries[ident] = entry

    def drop(self, repository: str, key: str) -> None:
        self._entries.pop((repository, key), None)

    def drop_repository(self, repository: str) -> int:
        """Forget every entry of ``repository`` (after a purge elsewhere in the fleet:
        the next request looks in the catalog again); how many."""
        gone = [ident for ident in self._entries if ident[0] == repository]
        for ident in gone:
            del self._entries[ident]
        return len(gone)


class AccessLog:
    """Last-access times noted on the hit path and flushed to the catalog in batches."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._pending: dict[tuple[str, str], int] = {}

    def record(self, repository: str, key: str) -> None:
        self._pending[(repository, key)] = self.clock.now_ms()

    async def flush(self, catalog: Catalog) -> int:
        if not self._pending:
            return 0
        pending, self._pending = self._pending, {}
        batch = [(repo, key, at) for (repo, key), at in pending.items()]
        written = 0
        try:
            for start in range(0, len(batch), ACCESS_FLUSH_BATCH):
                await catalog.touch_entries(batch[start : start + ACCESS_FLUSH_BATCH])
                written = start + ACCESS_FLUSH_BATCH
        except BaseException as exc:
            # Keep what was not written (also when cancelled: the shutdown flush follows).
            for repo, key, at in batch[written:]:
                self._pending.setdefault((repo, key), at)
            if not isinstance(exc, CatalogError):
                raise
            metrics.CATALOG_ERRORS.labels(operation="touch_entries").inc()
            log.warning("could not record %d access times: %s; will retry", len(batch), exc)
            return 0
        return len(batch)

"""Build-cache sweep: keep a Gradle build cache repository under its ``max_size``.

Least recently used entries (by last access, not by write time) go first, down to a
low-water mark so the sweep does not run again at the next write.
"""

from __future__ import annotations

from proxy import metrics
from proxy.cache import Cache
from proxy.catalog import Catalog
from proxy.config import RepositorySettings
from proxy.jobs.reclaim import remove_blob_if_orphan

LOW_WATER_FRACTION = 0.9
BATCH_ENTRIES = 500
RECENT_BLOB_GUARD_S = 600.0  # younger unreferenced blobs are left to the reclaim job


class BuildCacheSweep:
    def __init__(self, repo: RepositorySettings, catalog: Catalog, cache: Cache) -> None:
        assert repo.max_size is not None
        self.repo = repo
        self.max_size = repo.max_size
        self.catalog = catalog
        self.cache = cache

    async def run(self) -> str:
        # Our own buffered access times first, so LRU order reflects this replica's hits.
        await self.cache.access.flush(self.catalog)
        usage = await self.catalog.usage(self.repo.name)
        gauge = metrics.REPOSITORY_SIZE.labels(repository=self.repo.name)
        gauge.set(usage.bytes)
        if usage.bytes <= self.max_size:
            return f"{self.repo.name}: {usage.bytes} of {self.max_size} bytes used, nothing to do"
        target = int(self.max_size * LOW_WATER_FRACTION)
        remaining = usage.bytes
        evicted = 0
        while remaining > target:
            batch = await self.catalog.least_recently_used(self.repo.name, BATCH_ENTRIES)
            if not batch:
                break
            for entry in batch:
                if remaining <= target:
                    break
                if not await self.catalog.delete_entry(entry.repository, entry.key, entry.sha256):
                    continue  # overwritten or removed meanwhile
                self.cache.index.drop(entry.repository, entry.key)
                remaining -= entry.size
                evicted += 1
                metrics.ENTRIES_EVICTED.labels(repository=self.repo.name).inc()
                if entry.sha256 is not None:
                    await remove_blob_if_orphan(
                        self.catalog, self.cache.blobs, entry.sha256, RECENT_BLOB_GUARD_S
                    )
        gauge.set(remaining)
        return f"{self.repo.name}: evicted {evicted} entries, {usage.bytes} -> {remaining} bytes"

"""Repository sweep: keep a repository with its own size limit (a Gradle build cache's
``max_size``) under it.

Least recently used entries (by last access, not by write time) go first, down to a
low-water mark so the sweep does not run again at the next write. Like every other
removal, an evicted entry's blob is tombstoned and deleted after the grace period
(docs/architecture.md, "Eviction and retention").
"""

from __future__ import annotations

from proxy.cache import Cache
from proxy.catalog import Catalog
from proxy.runtime import metrics

LOW_WATER_FRACTION = 0.9
BATCH_ENTRIES = 500


class RepositorySweep:
    def __init__(self, repository: str, max_size: int, catalog: Catalog, cache: Cache) -> None:
        self.repository = repository
        self.max_size = max_size
        self.catalog = catalog
        self.cache = cache

    async def run(self) -> str:
        # Our own buffered access times first, so LRU order reflects this replica's hits.
        await self.cache.flush_access()
        usage = await self.catalog.usage(self.repository)
        gauge = metrics.REPOSITORY_SIZE.labels(repository=self.repository)
        gauge.set(usage.bytes)
        if usage.bytes <= self.max_size:
            return f"{self.repository}: {usage.bytes} of {self.max_size} bytes used, nothing to do"
        target = int(self.max_size * LOW_WATER_FRACTION)
        remaining = usage.bytes
        evicted = 0
        while remaining > target:
            batch = await self.catalog.least_recently_used(self.repository, BATCH_ENTRIES)
            if not batch:
                break
            for entry in batch:
                if remaining <= target:
                    break
                if not await self.cache.evict(entry):
                    continue  # overwritten or removed meanwhile
                remaining -= entry.size
                evicted += 1
                metrics.ENTRIES_EVICTED.labels(repository=self.repository).inc()
        gauge.set(remaining)
        return f"{self.repository}: evicted {evicted} entries, {usage.bytes} -> {remaining} bytes"

"""Eviction by size: keep the proxied entries of every repository together under
``storage.max_size`` (docs/architecture.md, "Eviction and retention").

One pass runs at a time for the fleet (the scheduler's claim and the job's lock). The
pass reads the total right before it deletes anything, and deletes least recently
accessed entries in small batches until the total is at or under the low watermark,
never further: it removes the overshoot, not the cache. Deleted entries' blobs are
tombstoned by the catalog; their files go only after ``jobs.evict_grace``, so a client
still reading one (on any replica) finishes. Every pass also deletes the blobs whose
grace is over and refreshes the storage gauges.
"""

from __future__ import annotations

import asyncio

from proxy.cache import Cache
from proxy.runtime import metrics
from proxy.units import human_size

BATCH_ENTRIES = 1000
# Between batches: other writers (access flushes, stored fetches) get the SQLite write
# lock, and hits on this process's catalog thread are not queued behind the pass.
BATCH_PAUSE_S = 0.005


class Eviction:
    def __init__(
        self, max_size: int | None, low_watermark: float, grace_s: float, cache: Cache
    ) -> None:
        self.max_size = max_size
        self.low_watermark = low_watermark
        self.grace_s = grace_s
        self.cache = cache

    async def run(self) -> str:
        # Our buffered access times first, so the order reflects this replica's hits.
        await self.cache.flush_access()
        usage = await self.cache.storage_usage()
        total = usage.proxied_bytes
        summary = f"{human_size(total)} proxied"
        if self.max_size is not None and total > self.max_size:
            target = int(self.max_size * self.low_watermark)
            evicted, freed = await self.evict(total - target)
            total -= freed
            summary = (
                f"evicted {evicted} entries ({human_size(freed)}): "
                f"{human_size(usage.proxied_bytes)} -> {human_size(total)} "
                f"(max {human_size(self.max_size)}, low watermark {human_size(target)})"
            )
            await self.cache.storage_usage()  # the gauges after the pass (tombstones grew)
        elif self.max_size is not None:
            summary += f" of {human_size(self.max_size)}, nothing to evict"
        purged = await self.cache.purge_tombstones(self.grace_s)
        return f"{summary}; deleted {purged.blobs} blobs past their grace"

    async def evict(self, overshoot: int) -> tuple[int, int]:
        """Delete least recently accessed entries until ``overshoot`` bytes are freed."""
        evicted = freed = 0
        while freed < overshoot:
            batch = await self.cache.evict_lru(overshoot - freed, BATCH_ENTRIES)
            if not batch:
                break
            size = sum(gone.size for gone in batch)
            evicted += len(batch)
            freed += size
            metrics.EVICTED_ENTRIES.labels(reason="size").inc(len(batch))
            metrics.EVICTED_BYTES.labels(reason="size").inc(size)
            await asyncio.sleep(BATCH_PAUSE_S)
        return evicted, freed

"""Retention: entries of a repository not accessed within its ``retention`` are removed
(docs/architecture.md, "Eviction and retention").

Access times are the catalog's ``last_access_ms``, written in batches by every replica
(no database write per hit). The pass deletes in small batches over the index on
(repository, last_access_ms); blobs are tombstoned and deleted after the grace period,
like eviction's.
"""

from __future__ import annotations

import asyncio

from proxy.cache import Cache
from proxy.clock import Clock
from proxy.runtime import metrics
from proxy.units import format_duration, human_size

BATCH_ENTRIES = 1000
BATCH_PAUSE_S = 0.005  # see jobs/evict.py


class Retention:
    def __init__(
        self, retentions: dict[str, float], grace_s: float, cache: Cache, clock: Clock
    ) -> None:
        self.retentions = retentions  # repository -> seconds
        self.grace_s = grace_s
        self.cache = cache
        self.clock = clock

    async def run(self) -> str:
        await self.cache.flush_access()
        parts = []
        for repository, retention_s in self.retentions.items():
            before_ms = self.clock.now_ms() - int(retention_s * 1000)
            removed = freed = 0
            while True:
                batch = await self.cache.expire_unused(repository, before_ms, BATCH_ENTRIES)
                size = sum(gone.size for gone in batch)
                removed += len(batch)
                freed += size
                metrics.EVICTED_ENTRIES.labels(reason="retention").inc(len(batch))
                metrics.EVICTED_BYTES.labels(reason="retention").inc(size)
                if len(batch) < BATCH_ENTRIES:
                    break
                await asyncio.sleep(BATCH_PAUSE_S)
            parts.append(
                f"{repository}: {removed} entries ({human_size(freed)}) unused for "
                f"{format_duration(retention_s)}"
            )
        purged = await self.cache.purge_tombstones(self.grace_s)
        return "; ".join(parts) + f"; deleted {purged.blobs} blobs past their grace"

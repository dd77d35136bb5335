"""Reclaim: what nothing needs any more.

Expired lease rows (after ``leases.retention``), what crashed writes left (temp files;
unfinished uploads to a bucket), long-expired negative entries, and blobs no entry
points to. A blob is removed only when it is old enough that no fetch or upload can be
about to record it (``Storage.orphan_min_age_s``).
"""

from __future__ import annotations

from proxy.catalog import Catalog
from proxy.clock import Clock
from proxy.runtime import metrics
from proxy.storage.store import Storage

STALE_TEMP_AGE_S = 24 * 3600.0
NEGATIVE_RETENTION_S = 3600.0
# Replicas not seen, purges every replica has seen and finished mirror runs are kept
# this long (the console shows them).
FLEET_HISTORY_S = 7 * 86400.0


class Reclaim:
    def __init__(
        self, catalog: Catalog, storage: Storage, clock: Clock, lease_retention_s: float
    ) -> None:
        self.catalog = catalog
        self.storage = storage
        self.clock = clock
        self.lease_retention_s = lease_retention_s

    async def run(self) -> str:
        leases = await self.catalog.purge_leases(self.lease_retention_s)
        metrics.LEASES_PURGED.inc(leases)
        now_s = self.clock.now_ms() / 1000
        temps = await self.storage.remove_leftovers(now_s - STALE_TEMP_AGE_S)
        negatives = await self.catalog.delete_expired_negatives(
            self.clock.now_ms() - int(NEGATIVE_RETENTION_S * 1000)
        )
        orphans = await self.remove_orphans()
        history = await self.catalog.forget_fleet_history(FLEET_HISTORY_S)
        return (
            f"purged {leases} lease rows, {temps} temp files and unfinished uploads, "
            f"{negatives} negative entries, {orphans} orphan blobs, "
            f"{history} old replica, purge and mirror-run rows"
        )

    async def remove_orphans(self) -> int:
        """Delete blobs older than the storage's ``orphan_min_age_s`` that no entry
        refers to and no tombstone names, asking the catalog once per batch of names.
        Blobs older than the catalog itself are not its orphans: a database.url naming
        another catalog than the store's (a typo, an empty database after a restore)
        would otherwise take every blob of the store for one."""
        cutoff_s = self.clock.now_ms() / 1000 - self.storage.orphan_min_age_s
        created_ms = await self.catalog.created_at_ms()
        if created_ms is None:
            return 0  # no migration recorded: not a catalog we may judge the store by
        removed = 0
        async for names in self.storage.candidates(cutoff_s, created_ms / 1000):
            orphans = await self.catalog.unreferenced_blobs(names)
            # The age is judged again at deletion (folder store): a fetch may have
            # published it since.
            deleted, _absent = await self.storage.delete(sorted(orphans), cutoff_s)
            removed += len(deleted)
        return removed

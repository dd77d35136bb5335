"""Reclaim: what nothing needs any more.

Expired lease rows (after ``leases.retention``), temp files left by crashed downloads,
long-expired negative entries, and blob files no entry points to. A blob is removed
only when it is old enough that no fetch or upload can be about to record it.
"""

from __future__ import annotations

import re

from proxy.catalog import Catalog
from proxy.clock import Clock
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.storage.blobs import BlobStore

STALE_TEMP_AGE_S = 24 * 3600.0
ORPHAN_BLOB_MIN_AGE_S = 3600.0
NEGATIVE_RETENTION_S = 3600.0
# Replicas not seen, purges every replica has seen and finished mirror runs are kept
# this long (the console shows them).
FLEET_HISTORY_S = 7 * 86400.0
# Names per catalog question of the orphan sweep: one statement per batch, not per blob.
ORPHAN_BATCH = 1000
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class Reclaim:
    def __init__(
        self, catalog: Catalog, blobs: BlobStore, clock: Clock, lease_retention_s: float
    ) -> None:
        self.catalog = catalog
        self.blobs = blobs
        self.clock = clock
        self.lease_retention_s = lease_retention_s

    async def run(self) -> str:
        leases = await self.catalog.purge_leases(self.lease_retention_s)
        metrics.LEASES_PURGED.inc(leases)
        now_s = self.clock.now_ms() / 1000
        temps = await run_blocking(self.blobs.remove_stale_temps, now_s - STALE_TEMP_AGE_S)
        negatives = await self.catalog.delete_expired_negatives(
            self.clock.now_ms() - int(NEGATIVE_RETENTION_S * 1000)
        )
        orphans = await self.remove_orphans()
        history = await self.catalog.forget_fleet_history(FLEET_HISTORY_S)
        return (
            f"purged {leases} lease rows, {temps} temp files, "
            f"{negatives} negative entries, {orphans} orphan blobs, "
            f"{history} old replica, purge and mirror-run rows"
        )

    async def remove_orphans(self) -> int:
        """Delete blob files older than ``ORPHAN_BLOB_MIN_AGE_S`` that no entry refers to
        and no tombstone names, asking the catalog once per ``ORPHAN_BATCH`` names."""
        cutoff_s = self.clock.now_ms() / 1000 - ORPHAN_BLOB_MIN_AGE_S

        def candidates() -> list[str]:
            return [
                sha
                for sha, _size, mtime in self.blobs.iter_blobs()
                if mtime < cutoff_s and _SHA256_RE.match(sha)
            ]

        names = await run_blocking(candidates)
        removed = 0
        for start in range(0, len(names), ORPHAN_BATCH):
            orphans = await self.catalog.unreferenced_blobs(names[start : start + ORPHAN_BATCH])
            # The age is judged again at deletion: a fetch may have published it since.
            deleted, _absent = await run_blocking(
                self.blobs.delete_older, sorted(orphans), cutoff_s
            )
            removed += len(deleted)
        return removed

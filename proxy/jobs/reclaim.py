"""Reclaim: what nothing needs any more.

Expired lease rows (after ``leases.retention``), temp files left by crashed downloads,
long-expired negative entries, and blob files no entry points to. A blob is removed
only when it is old enough that no fetch or upload can be about to record it.
"""

from __future__ import annotations

import os
import re
import time

from proxy import metrics
from proxy.blobs import BlobStore
from proxy.blocking import run_blocking
from proxy.catalog import Catalog, now_ms
from proxy.config import Settings

STALE_TEMP_AGE_S = 24 * 3600.0
ORPHAN_BLOB_MIN_AGE_S = 3600.0
NEGATIVE_RETENTION_S = 3600.0
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


async def remove_blob_if_orphan(
    catalog: Catalog, blobs: BlobStore, sha256: str, min_age_s: float
) -> bool:
    """Delete the blob if no entry points to it and it is older than ``min_age_s``.

    The age guard closes the window between a writer publishing a blob and recording
    the entry that points to it (a same-content publish refreshes the file's mtime).
    """
    try:
        mtime = os.stat(blobs.path(sha256)).st_mtime
    except FileNotFoundError:
        return False
    if time.time() - mtime < min_age_s:
        return False
    if await catalog.blob_is_referenced(sha256):
        return False
    return await blobs.delete(sha256)


class Reclaim:
    def __init__(self, settings: Settings, catalog: Catalog, blobs: BlobStore) -> None:
        self.settings = settings
        self.catalog = catalog
        self.blobs = blobs

    async def run(self) -> str:
        leases = await self.catalog.purge_leases(self.settings.leases.retention_s)
        metrics.LEASES_PURGED.inc(leases)
        temps = await run_blocking(self.blobs.remove_stale_temps, STALE_TEMP_AGE_S)
        negatives = await self.catalog.delete_expired_negatives(
            now_ms() - int(NEGATIVE_RETENTION_S * 1000)
        )
        orphans = await self.remove_orphans()
        return (
            f"purged {leases} lease rows, {temps} temp files, "
            f"{negatives} negative entries, {orphans} orphan blobs"
        )

    async def remove_orphans(self) -> int:
        cutoff = time.time() - ORPHAN_BLOB_MIN_AGE_S

        def candidates() -> list[str]:
            return [
                sha
                for sha, _size, mtime in self.blobs.iter_blobs()
                if mtime < cutoff and _SHA256_RE.match(sha)
            ]

        removed = 0
        for sha256 in await run_blocking(candidates):
            if await remove_blob_if_orphan(self.catalog, self.blobs, sha256, ORPHAN_BLOB_MIN_AGE_S):
                removed += 1
        return removed

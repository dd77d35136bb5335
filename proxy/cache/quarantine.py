"""A blob found corrupt is never served again (docs/architecture.md, "Blobs verified
when read").

``Quarantine`` is what every reader hands a ``Corruption`` to: a hit whose file has the
wrong size or digest, a cold read whose object is not its name's, the scrub, ``proxy
verify``. It moves the file aside (``Storage.quarantine``: ``{storage}/quarantine/`` on a
folder; on object storage this replica's copy is dropped), deletes every entry naming the
blob (one statement; the triggers tombstone it), forgets it in this process's memories
(entry index, hot LRU, stamps, mark counts), logs it once at ERROR with what was found,
and counts it. The next request for any of those keys misses and fetches it from the
upstream; other replicas of a shared volume find the file gone and do the same.

Concurrent finds of one blob share one quarantine; a file already quarantined (the same
inode) is not quarantined again by a reader that opened it before it was moved.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from proxy.catalog import Catalog, Removed
from proxy.exceptions import CatalogError
from proxy.fetch.index import EntryIndex
from proxy.http.bodies import HotBlobs, MarkCounts
from proxy.runtime import metrics
from proxy.runtime.tasks import TaskSupervisor
from proxy.storage.integrity import Corruption, Stamp
from proxy.storage.store import Storage

log = logging.getLogger("proxy.quarantine")

RECENT_CAPACITY = 1024  # files already quarantined, remembered so they are not twice
ENTRIES_LOGGED = 10  # entries named in the log line; the count says how many more


@dataclass(frozen=True)
class Quarantined:
    done: str  # what happened to the copy found corrupt, for a log line
    removed: list[Removed] = field(default_factory=list)  # the entries deleted


class Quarantine:
    def __init__(
        self,
        catalog: Catalog,
        storage: Storage,
        index: EntryIndex,
        hot: HotBlobs,
        marks: MarkCounts,
        tasks: TaskSupervisor,
    ) -> None:
        self.catalog = catalog
        self.storage = storage
        self.index = index
        self.hot = hot
        self.marks = marks
        self.tasks = tasks
        self._running: dict[str, asyncio.Task[Quarantined]] = {}
        self._recent: OrderedDict[tuple[str, Stamp], None] = OrderedDict()

    async def __call__(self, found: Corruption) -> None:
        await self.blob(found)

    async def blob(self, found: Corruption) -> Quarantined:
        """Quarantine the blob ``found`` describes. Shielded: a reader that leaves
        meanwhile does not stop it."""
        task = self._running.get(found.sha256)
        if task is None:
            if found.stamp is not None and (found.sha256, found.stamp) in self._recent:
                return Quarantined("quarantined already")  # read before it was moved
            task = self.tasks.spawn(f"quarantine:{found.sha256[:12]}", self._quarantine(found))
            self._running[found.sha256] = task
            task.add_done_callback(lambda _t: self._running.pop(found.sha256, None))
        return await asyncio.shield(task)

    async def _quarantine(self, found: Corruption) -> Quarantined:
        sha256 = found.sha256
        if found.stamp is not None:
            self._recent[(sha256, found.stamp)] = None
            if len(self._recent) > RECENT_CAPACITY:
                self._recent.popitem(last=False)
        # Forgotten here first: no request of this process reads the bytes again.
        self.hot.drop(sha256)
        self.marks.forget(sha256)
        self.storage.files.stamps.forget(sha256)
        done = await self.storage.quarantine(found)
        try:
            removed = await self.catalog.delete_blob_entries(sha256)
        except CatalogError as exc:
            # The file is out of the way, so hits find it gone and fetch it again.
            removed = []
            log.warning("blob %s: could not delete the entries naming it: %s", sha256, exc)
        for entry in removed:
            self.index.drop(entry.repository, entry.key)
        metrics.BLOBS_QUARANTINED.labels(reason=found.reason).inc()
        named = ", ".join(f"{r.repository}/{r.key}" for r in removed[:ENTRIES_LOGGED])
        more = f" and {len(removed) - ENTRIES_LOGGED} more" if len(removed) > ENTRIES_LOGGED else ""
        log.error(
            "blob %s is corrupt in %s (%s): quarantined, %s; %d entries deleted%s, so the "
            "next request fetches it again",
            sha256,
            self.storage.description,
            found.describe(),
            done,
            len(removed),
            f" ({named}{more})" if removed else "",
        )
        return Quarantined(done, removed)

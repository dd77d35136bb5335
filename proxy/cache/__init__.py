"""The cache as jobs and the repository views see it: look a key up, serve a stored
entry, evict entries and delete their blobs after the grace period
(docs/architecture.md, "Module map", "Eviction and retention").

``Cache`` owns the shared pieces (catalog, blobs, the in-memory entry index, access
times, the fetcher). Each repository's adapter sees one view of it, narrowed to what
its kind of repository does: ``proxied.ProxiedView`` (``contract.ProxyCache``) or
``hosted.HostedView`` (``contract.HostedCache``). Formats never see anything else of
the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from proxy.cache.quarantine import Quarantine
from proxy.catalog import Catalog, Entry, Removed, StorageUsage
from proxy.clock import Clock
from proxy.contract import FetchSpec, Request, Response
from proxy.exceptions import CatalogError
from proxy.fetch.fetcher import Fetcher, under_current_ttl
from proxy.fetch.index import AccessLog, EntryIndex
from proxy.http import responses
from proxy.http.bodies import BlobBody, BlobFiles, FileBody, HotBlobs, MarkCounts
from proxy.runtime import metrics
from proxy.storage.store import Storage
from proxy.types import Kind

log = logging.getLogger("proxy.cache")

TOMBSTONE_BATCH = 10_000
# Requests a redirect to the bucket would answer by the object's validators, not ours.
CONDITIONAL_HEADERS = ("if-none-match", "if-modified-since", "if-unmodified-since", "if-range")
# A blob file younger than this is never deleted by the tombstone purge: it was just
# published again by a fetch whose entry is about to be recorded (if none is, reclaim
# removes the orphan later). The object store has no such cheap look at an object's age
# (docs/architecture.md, "Object storage"): the "blob vanished" path refetches instead.
RECENT_BLOB_GUARD_S = 60.0

# How a hit reads an entry's blob here. Object storage reads the local tier or fills it;
# the folder store opens files. Either hands what it finds corrupt to the quarantine.
Bodies = Callable[[Entry], BlobBody]


@dataclass(frozen=True)
class Purged:
    blobs: int = 0
    bytes: int = 0


class Cache:
    def __init__(
        self,
        catalog: Catalog,
        storage: Storage,
        fetcher: Fetcher,
        index: EntryIndex,
        access: AccessLog,
        hot: HotBlobs,
        clock: Clock,
        marks: MarkCounts,
        files: BlobFiles,
        quarantine: Quarantine,
        bodies: Bodies | None = None,
        redirect_min_size: int | None = None,
    ) -> None:
        """``files``: how blob files are opened (stamps, ``storage.verify_reads``);
        ``redirect_min_size``: hits on immutable files at least this large are
        redirected to the storage (``Storage.redirect``), if it offers a URL."""
        self.catalog = catalog
        self.storage = storage
        self.fetcher = fetcher
        self.index = index
        self.access = access
        self.hot = hot
        self.clock = clock
        self.marks = marks
        self.files = files
        self.quarantine = quarantine
        self.bodies = bodies or self._file_body
        self.redirect_min_size = redirect_min_size

    def _file_body(self, entry: Entry) -> BlobBody:
        assert entry.sha256 is not None
        path = self.storage.blob_path(entry.sha256)
        return FileBody(self.files, path, entry.sha256, entry.size, self.quarantine)

    def body(self, entry: Entry) -> BlobBody:
        """Where a hit on ``entry`` reads its bytes; a copy found corrupt on the way is
        quarantined, and the blob is gone for the caller (FileNotFoundError), so it is
        fetched again (docs/architecture.md, "Blobs verified when read")."""
        return self.bodies(entry)

    async def lookup(
        self, repository: str, key: str, spec: FetchSpec | None = None
    ) -> Entry | None:
        """The entry for a key, fresh or not; memory first, then the catalog. With the
        key's ``spec``, its expiry is the one the current TTLs give it."""
        entry = self.index.get(repository, key)
        if entry is not None:
            if spec is not None:
                entry = under_current_ttl(entry, spec)
            if entry.is_fresh(self.clock.now_ms()):
                return entry
        entry = await self.catalog.get_entry(repository, key)
        if entry is not None:
            if spec is not None:
                entry = under_current_ttl(entry, spec)
            self.index.put(entry)
        return entry

    async def forget(self, entry: Entry) -> None:
        """Drop an entry whose blob is gone (so the next request fetches it again)."""
        self.index.drop(entry.repository, entry.key)
        try:
            await self.catalog.delete_entry(entry.repository, entry.key, entry.sha256)
        except CatalogError as exc:
            log.warning(
                "could not forget repository=%s key=%s: %s", entry.repository, entry.key, exc
            )

    async def evict(self, entry: Entry) -> bool:
        """Remove ``entry`` if it still points at the same blob. False if it changed
        meanwhile. Its blob is tombstoned (by the catalog) and deleted by
        ``purge_tombstones`` after the grace period, if no entry refers to it then."""
        if not await self.catalog.delete_entry(entry.repository, entry.key, entry.sha256):
            return False
        self.index.drop(entry.repository, entry.key)
        return True

    async def evict_lru(self, free_bytes: int, limit: int) -> list[Removed]:
        """One batch of the eviction pass: least recently accessed proxied entries."""
        removed = await self.catalog.evict_lru(free_bytes, limit)
        self._forget_removed(removed)
        return removed

    async def expire_unused(self, repository: str, before_ms: int, limit: int) -> list[Removed]:
        """One batch of the retention pass."""
        removed = await self.catalog.expire_unused(repository, before_ms, limit)
        self._forget_removed(removed)
        return removed

    def _forget_removed(self, removed: list[Removed]) -> None:
        for gone in removed:
            self.index.drop(gone.repository, gone.key)

    async def purge_tombstones(self, grace_s: float) -> Purged:
        """Delete the files of blobs unreferenced for longer than ``grace_s``.

        A tombstone is forgotten only once its file is gone: a file too young to delete
        (``RECENT_BLOB_GUARD_S``) keeps its tombstone, and a later pass deletes it
        (docs/architecture.md, "Eviction and retention")."""
        await self.catalog.drop_referenced_tombstones()
        cutoff_s = self.clock.now_ms() / 1000 - RECENT_BLOB_GUARD_S
        blobs = size = 0
        after = ""
        while True:
            due = await self.catalog.due_tombstones(grace_s, after, TOMBSTONE_BATCH)
            if not due:
                break
            deleted, absent = await self.storage.delete([sha for sha, _ in due], cutoff_s)
            await self.catalog.forget_tombstones(sorted(deleted | absent))
            blobs += len(deleted)
            size += sum(n for sha, n in due if sha in deleted)
            if len(due) < TOMBSTONE_BATCH:
                break
            after = due[-1][0]
        metrics.BLOBS_DELETED.inc(blobs)
        return Purged(blobs, size)

    async def storage_usage(self) -> StorageUsage:
        """Totals over every repository; also sets the ``proxy_storage_bytes`` gauges."""
        usage = await self.catalog.storage_usage()
        metrics.STORAGE_BYTES.labels(kind="proxied").set(usage.proxied_bytes)
        metrics.STORAGE_BYTES.labels(kind="hosted").set(usage.hosted_bytes)
        metrics.STORAGE_BYTES.labels(kind="tombstoned").set(usage.tombstoned_bytes)
        return usage

    async def flush_access(self) -> int:
        """Write this process's buffered access times now (before judging LRU order)."""
        return await self.access.flush(self.catalog)

    async def render_entry(
        self,
        entry: Entry,
        request: Request,
        extra: Mapping[str, str],
        base_url: str | None = None,
    ) -> Response:
        """Serve a stored entry: as is, or with its base-URL marks replaced by
        ``base_url`` (docs/architecture.md, "Requests"). Raises FileNotFoundError if its
        blob is gone."""
        return await self.render_body(entry, self.body(entry), request, extra, base_url)

    async def render_body(
        self,
        entry: Entry,
        body: BlobBody,
        request: Request,
        extra: Mapping[str, str],
        base_url: str | None = None,
    ) -> Response:
        """Serve ``entry`` with its bytes from ``body`` (an index document's rendering is
        a file of its own). Raises FileNotFoundError if they are gone."""
        assert entry.sha256 is not None
        now_ms = self.clock.now_ms()
        if base_url is not None:
            return await responses.relocated_blob(
                request.headers, request.method, entry, body, self.hot, self.marks, extra,
                now_ms, base_url,
            )  # fmt: skip
        if (
            self.redirect_min_size is not None
            and entry.size >= self.redirect_min_size
            and entry.kind is Kind.IMMUTABLE  # never a page: its headers are ours
            and request.method == "GET"
            # A conditional request is judged here: the bucket's ETag and date are not
            # the ones we gave (a revalidation would get the whole file, not a 304).
            and not any(name in request.headers for name in CONDITIONAL_HEADERS)
        ):
            url = await self.storage.redirect(entry.sha256, entry.size)
            if url is not None:
                return responses.redirect_to_storage(url)
        return await responses.blob(
            request.headers, request.method, entry, body, self.hot, extra, now_ms
        )

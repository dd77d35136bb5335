"""The engine as formats and jobs see it: look a key up, serve it, fetch it, store an
upload, evict entries and delete their blobs after the grace period
(docs/architecture.md, "Module map", "Eviction and retention").

``Cache`` owns the shared pieces (catalog, blobs, the in-memory entry index, access
times, the fetcher). ``Cache.for_repository`` gives each adapter a ``RepositoryView``:
the ``RepositoryCache`` of ``proxy/contract.py``, bound to one repository, with the
``OriginContext`` its origins receive. Formats never see anything else of the engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass

from proxy.cache.index import AccessLog, EntryIndex
from proxy.catalog import Catalog, Entry, Removed, StorageUsage
from proxy.clock import Clock
from proxy.contract import (
    FetchSpec,
    OriginContext,
    Request,
    Response,
    UpstreamClient,
    WarmResult,
)
from proxy.exceptions import (
    CatalogError,
    NotFound,
    PayloadTooLarge,
    StorageError,
    UpstreamError,
    UpstreamUnavailable,
)
from proxy.fetch.fetcher import (
    Fetcher,
    Inline,
    Miss,
    Missing,
    Outcome,
    Stale,
    Stored,
    Streaming,
    under_current_ttl,
)
from proxy.http import responses
from proxy.http.access_log import note_outcome
from proxy.http.responses import HotBlobs
from proxy.runtime import metrics
from proxy.runtime.blocking import CpuPool, run_blocking
from proxy.storage.blobs import BlobStore
from proxy.types import Digests, Kind, Link, LinkBatch

log = logging.getLogger("proxy.cache")

CHECKSUM_HEADER_DIGESTS = ("sha1", "md5", "sha256")
TOMBSTONE_BATCH = 10_000
# A blob file younger than this is never deleted by the tombstone purge: it was just
# published again by a fetch whose entry is about to be recorded (if none is, reclaim
# removes the orphan later).
RECENT_BLOB_GUARD_S = 60.0


@dataclass(frozen=True)
class Purged:
    blobs: int = 0
    bytes: int = 0


class Cache:
    def __init__(
        self,
        catalog: Catalog,
        blobs: BlobStore,
        fetcher: Fetcher,
        index: EntryIndex,
        access: AccessLog,
        hot: HotBlobs,
        clock: Clock,
    ) -> None:
        self.catalog = catalog
        self.blobs = blobs
        self.fetcher = fetcher
        self.index = index
        self.access = access
        self.hot = hot
        self.clock = clock

    def for_repository(
        self, name: str, format_name: str, upstream: UpstreamClient, cpu: CpuPool
    ) -> RepositoryView:
        return RepositoryView(self, name, format_name, upstream, cpu)

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
            deleted, absent = await run_blocking(
                self.blobs.delete_older, [sha for sha, _ in due], cutoff_s
            )
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


class CatalogLinks:
    """The ``LinkStore`` of one repository, kept in the catalog."""

    def __init__(self, catalog: Catalog, repository: str) -> None:
        self.catalog = catalog
        self.repository = repository

    async def record(self, links: Iterable[Link] | LinkBatch) -> None:
        if isinstance(links, LinkBatch):
            await self.catalog.put_links(links)
            return
        batch = list(links)
        if any(link.repository != self.repository for link in batch):
            raise ValueError(f"links recorded for {self.repository!r} name another repository")
        await self.catalog.put_links(batch)

    async def get(self, key: str) -> Link | None:
        return await self.catalog.get_link(self.repository, key)


class RepositoryView:
    """``contract.RepositoryCache`` for one repository."""

    def __init__(
        self, cache: Cache, name: str, format_name: str, upstream: UpstreamClient, cpu: CpuPool
    ) -> None:
        self.cache = cache
        self.name = name
        self.format = format_name
        self.links = CatalogLinks(cache.catalog, name)
        self.origin_context = OriginContext(
            upstream=upstream, links=self.links, get=self.warm, compute=cpu.run
        )

    # -- proxied keys --------------------------------------------------------------------

    async def _outcome(self, spec: FetchSpec) -> tuple[Outcome, bool]:
        """The key's outcome, and whether it was a fresh hit (no fetch at all)."""
        entry = await self.cache.lookup(self.name, spec.key, spec)
        hit = self._fresh_hit(spec, entry)
        if hit is not None:
            return hit, True
        return await self._miss(spec, entry), False

    def _fresh_hit(self, spec: FetchSpec, entry: Entry | None) -> Outcome | None:
        """The outcome of a fresh entry, counted as a hit; None if it must be fetched.
        (Not a coroutine: this is the hit path.)"""
        if entry is None or not entry.is_fresh(self.cache.clock.now_ms()):
            return None
        if entry.kind is Kind.NEGATIVE:
            metrics.NEGATIVE_HITS.labels(repository=self.name).inc()
            note_outcome("negative")
            return Missing(f"{spec.key} not found upstream (cached)")
        metrics.CACHE_HITS.labels(self.name, self.format, entry.kind.value).inc()
        note_outcome("hit")
        self.cache.access.record(self.name, spec.key)
        return Stored(entry)

    async def _miss(self, spec: FetchSpec, entry: Entry | None) -> Outcome:
        """Fetch a key with no fresh entry (``entry``: the expired one, if any)."""
        metrics.CACHE_MISSES.labels(self.name, self.format, spec.kind.value).inc()
        note_outcome("miss")
        stale = entry if entry is not None and entry.kind is Kind.METADATA else None
        return await self._fetch(spec, stale)

    async def _fetch(self, spec: FetchSpec, stale: Entry | None) -> Outcome:
        miss = Miss(self.name, self.format, spec, self.origin_context)
        return await self.cache.fetcher.fetch(miss, stale)

    async def _refetch(self, spec: FetchSpec, entry: Entry) -> Outcome:
        """The blob went away under ``entry`` (evicted by another replica, or removed by
        hand): forget the entry and fetch again."""
        await self.cache.forget(entry)
        metrics.CACHE_MISSES.labels(self.name, self.format, spec.kind.value).inc()
        return await self._fetch(spec, stale=None)

    @staticmethod
    def _vanished(spec: FetchSpec) -> StorageError:
        # A fetch just stored this blob and it is gone again: the storage is at fault,
        # never the artifact (a 404 would make clients believe it does not exist).
        return StorageError(f"{spec.key}: its blob vanished right after it was stored")

    @staticmethod
    async def _entry_of(
        spec: FetchSpec, outcome: Stored | Stale | Streaming, unrecorded: str
    ) -> Entry:
        """The entry an outcome ends with: a download's once it is stored and recorded
        (if it could not be recorded, a 503 saying ``unrecorded``)."""
        if not isinstance(outcome, Streaming):
            return outcome.entry
        entry = await outcome.transfer.result()
        if entry is None:
            raise UpstreamUnavailable(f"{spec.key}: {unrecorded}; retry", status=503)
        return entry

    async def respond(
        self,
        spec: FetchSpec,
        request: Request,
        headers: Mapping[str, str] | None = None,
        checksum_headers: bool = False,
    ) -> Response:
        extra = dict(headers or {})
        outcome, _hit = await self._outcome(spec)
        for attempt in (1, 2):
            answer_headers = extra
            if checksum_headers and isinstance(outcome, Stored | Stale):
                answer_headers = {**extra, **checksum_headers_of(outcome.entry)}
            try:
                return await self._render(outcome, spec, request, answer_headers)
            except FileNotFoundError:
                assert isinstance(outcome, Stored | Stale)
                if attempt == 2:
                    break
                outcome = await self._refetch(spec, outcome.entry)  # once
        raise self._vanished(spec)

    async def _render(
        self, outcome: Outcome, spec: FetchSpec, request: Request, extra: dict[str, str]
    ) -> Response:
        if isinstance(outcome, Stored):
            return await self._render_entry(outcome.entry, request, extra)
        if isinstance(outcome, Stale):
            note_outcome("stale")
            # Expired: say so, and let no cache keep it.
            extra = {**extra, "warning": '110 - "Response is Stale"', "cache-control": "no-cache"}
            return await self._render_entry(outcome.entry, request, extra)
        if isinstance(outcome, Streaming):
            if outcome.transfer.verified():
                # Only storing remains (fsync, catalog): a request that comes now is
                # answered as the stored entry (ETag, Range, 304), like right after.
                entry = await outcome.transfer.result()
                if entry is not None:
                    with contextlib.suppress(FileNotFoundError):
                        return await self._render_entry(entry, request, extra)
            now_ms = self.cache.clock.now_ms()
            policy = responses.cache_control(spec.kind, spec.expires_at_ms(now_ms), now_ms)
            return responses.downloading(request.method, outcome.transfer, extra, self.name, policy)
        if isinstance(outcome, Inline):
            return responses.inline(
                request.headers,
                request.method,
                outcome.body,
                outcome.content_type,
                extra,
                self.name,
            )
        raise NotFound(outcome.message)

    async def _render_entry(
        self, entry: Entry, request: Request, extra: Mapping[str, str]
    ) -> Response:
        """Serve a stored entry as is; raises FileNotFoundError if its blob is gone."""
        assert entry.sha256 is not None
        path = self.cache.blobs.path_str(entry.sha256)
        return await responses.blob(
            request.headers, request.method, entry, path, self.cache.hot, extra,
            self.cache.clock.now_ms(),
        )  # fmt: skip

    async def is_fresh(self, key: str) -> bool:
        entry = await self.cache.lookup(self.name, key)
        return entry is not None and entry.is_fresh(self.cache.clock.now_ms())

    async def served_digests(self, spec: FetchSpec) -> Digests:
        existing = await self.cache.lookup(self.name, spec.key, spec)
        if existing is not None and existing.sha256 is not None:
            return existing.digests  # expired or not: it is what clients were given
        outcome = self._fresh_hit(spec, existing)
        if outcome is None:
            outcome = await self._miss(spec, existing)
        if isinstance(outcome, Missing):
            raise NotFound(outcome.message)
        if isinstance(outcome, Inline):
            return {
                name: hashlib.new(name, outcome.body).hexdigest()
                for name in ("md5", "sha1", "sha256", "sha512")
            }
        return (await self._entry_of(spec, outcome, "checksum not available yet")).digests

    async def read(self, spec: FetchSpec, limit: int) -> bytes:
        outcome, _hit = await self._outcome(spec)
        for attempt in (1, 2):
            if isinstance(outcome, Missing):
                raise NotFound(outcome.message)
            if isinstance(outcome, Inline):
                body = outcome.body
            else:
                entry = await self._entry_of(spec, outcome, "stored but not recorded")
                assert entry.sha256 is not None
                if entry.size > limit:
                    raise UpstreamError(f"{spec.key}: {entry.size} bytes, over {limit}")
                try:
                    body = await run_blocking(self.cache.blobs.path(entry.sha256).read_bytes)
                except FileNotFoundError:
                    if attempt == 2:
                        break
                    outcome = await self._refetch(spec, entry)
                    continue
            if len(body) > limit:
                raise UpstreamError(f"{spec.key}: {len(body)} bytes, over {limit}")
            return body
        raise self._vanished(spec)

    async def warm(self, spec: FetchSpec) -> WarmResult:
        outcome, hit = await self._outcome(spec)
        if isinstance(outcome, Missing):
            return WarmResult("missing")
        if isinstance(outcome, Inline):
            return WarmResult("fetched", len(outcome.body))
        if isinstance(outcome, Streaming):
            entry = await outcome.transfer.result()
            return WarmResult("fetched", entry.size if entry is not None else 0)
        return WarmResult("cached" if hit else "fetched", outcome.entry.size)

    # -- uploads ---------------------------------------------------------------------------

    async def store_upload(
        self, key: str, body: AsyncIterator[bytes], max_size: int, content_type: str | None
    ) -> None:
        cache = self.cache
        temp = await cache.blobs.new_temp()
        try:
            async for chunk in body:
                if temp.size + len(chunk) > max_size:
                    self.count_upload("too_large")
                    raise PayloadTooLarge(f"{key}: the body is over the {max_size}-byte limit")
                await temp.write(chunk)
            sha256 = await cache.blobs.publish(temp)
        except BaseException:
            await temp.discard()
            raise
        stored_at = cache.clock.now_ms()
        entry = Entry(
            repository=self.name,
            key=key,
            kind=Kind.HOSTED,
            sha256=sha256,
            size=temp.size,
            content_type=content_type,
            fetched_at_ms=stored_at,
            expires_at_ms=None,
            digests=temp.digests(),
            last_access_ms=stored_at,
        )
        await cache.catalog.put_entry(entry)
        self.count_upload("stored")
        note_outcome("upload")

    async def serve_upload(self, key: str, request: Request, content_type: str) -> Response:
        entry = await self.cache.lookup(self.name, key)
        if entry is None or entry.kind is not Kind.HOSTED:
            raise NotFound(f"no entry {key}")
        if request.method == "GET":
            # Only a read is a use; a HEAD probe must not keep an entry from eviction.
            self.cache.access.record(self.name, key)
        metrics.CACHE_HITS.labels(self.name, self.format, Kind.HOSTED.value).inc()
        note_outcome("hit")
        try:
            return await self._render_entry(entry, request, {"content-type": content_type})
        except FileNotFoundError:
            await self.cache.forget(entry)
            raise NotFound(f"no entry {key}") from None

    def count_upload(self, result: str) -> None:
        metrics.UPLOADS.labels(self.name, result).inc()


def checksum_headers_of(entry: Entry) -> dict[str, str]:
    """``X-Checksum-Sha1`` and friends: only digests we computed from these very bytes."""
    return {
        f"x-checksum-{name}": entry.digests[name]
        for name in CHECKSUM_HEADER_DIGESTS
        if name in entry.digests
    }

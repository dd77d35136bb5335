"""The cache layer formats talk to: look a key up, serve it, or fetch it.

Formats never touch SQL or files: they describe a key with a ``FetchSpec`` and get an
ASGI response back from ``Cache.respond``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence

from proxy import metrics, responses
from proxy.blobs import BlobStore
from proxy.catalog import Catalog, Entry, Link, now_ms
from proxy.entry_index import AccessLog, EntryIndex
from proxy.exceptions import CatalogError, NotFound, PayloadTooLarge, StorageError
from proxy.fetch import Fetcher, FetchSpec, Inline, Missing, Outcome, Stale, Stored, Streaming
from proxy.responses import BodyResponse, DownloadResponse, FileResponse, HotBlobs
from proxy.types import Kind

log = logging.getLogger("proxy.cache")

Response = BodyResponse | FileResponse | DownloadResponse


class Cache:
    def __init__(
        self,
        catalog: Catalog,
        blobs: BlobStore,
        fetcher: Fetcher,
        index: EntryIndex,
        access: AccessLog,
        hot: HotBlobs,
    ) -> None:
        self.catalog = catalog
        self.blobs = blobs
        self.fetcher = fetcher
        self.index = index
        self.access = access
        self.hot = hot

    async def lookup(self, repository: str, key: str) -> Entry | None:
        """The entry for a key, fresh or not; memory first, then the catalog."""
        entry = self.index.get(repository, key)
        if entry is not None and entry.is_fresh():
            return entry
        entry = await self.catalog.get_entry(repository, key)
        if entry is not None:
            self.index.put(entry)
        return entry

    async def get(self, spec: FetchSpec) -> Outcome:
        entry = await self.lookup(spec.repository, spec.key)
        if entry is not None and entry.is_fresh():
            if entry.kind is Kind.NEGATIVE:
                metrics.NEGATIVE_HITS.labels(repository=spec.repository).inc()
                return Missing(f"{spec.key} not found upstream (cached)")
            metrics.CACHE_HITS.labels(spec.repository, spec.format, entry.kind.value).inc()
            self.access.record(spec.repository, spec.key)
            return Stored(entry)
        metrics.CACHE_MISSES.labels(spec.repository, spec.format, spec.kind.value).inc()
        stale = entry if entry is not None and entry.kind is Kind.METADATA else None
        return await self.fetcher.fetch(spec, stale)

    async def respond(
        self,
        spec: FetchSpec,
        method: str,
        request_headers: Mapping[str, str],
        extra_headers: Mapping[str, str] | None = None,
        checksum_headers: bool = False,
    ) -> Response:
        """Serve ``spec.key``: from the cache if fresh, else through the miss path.

        ``checksum_headers`` adds ``X-Checksum-*`` headers computed from the served bytes.
        """
        extra = dict(extra_headers or {})
        outcome = await self.get(spec)
        for attempt in (1, 2):
            headers = extra
            if checksum_headers and isinstance(outcome, Stored | Stale):
                headers = {**extra, **checksum_headers_of(outcome.entry)}
            try:
                return await self.render(outcome, method, request_headers, headers, spec.repository)
            except FileNotFoundError:
                assert isinstance(outcome, Stored | Stale)
                if attempt == 2:
                    break
                # The blob went away under the entry (evicted by another replica, or
                # removed by hand): forget the entry and fetch again, once.
                await self.forget(outcome.entry)
                metrics.CACHE_MISSES.labels(spec.repository, spec.format, spec.kind.value).inc()
                outcome = await self.fetcher.fetch(spec, stale=None)
        # A fetch just stored this blob and it is gone again: the storage is at fault,
        # never the artifact (a 404 would make clients believe it does not exist).
        raise StorageError(f"{spec.key}: its blob vanished right after it was stored")

    async def render(
        self,
        outcome: Outcome,
        method: str,
        request_headers: Mapping[str, str],
        extra: dict[str, str],
        repository: str,
    ) -> Response:
        if isinstance(outcome, Stored):
            return await self.render_entry(outcome.entry, method, request_headers, extra)
        if isinstance(outcome, Stale):
            extra = {**extra, "warning": '110 - "Response is Stale"'}
            return await self.render_entry(outcome.entry, method, request_headers, extra)
        if isinstance(outcome, Streaming):
            return responses.downloading(method, outcome.download, extra, repository)
        if isinstance(outcome, Inline):
            return responses.inline(
                request_headers, method, outcome.body, outcome.content_type, extra, repository
            )
        raise NotFound(outcome.message)

    async def store_hosted(
        self,
        repository: str,
        key: str,
        chunks: AsyncIterator[bytes],
        max_size: int,
        content_type: str | None,
    ) -> Entry:
        """Store a client's upload; durable (fsynced file + committed row) on return.

        Raises ``PayloadTooLarge`` (and stores nothing) past ``max_size`` bytes.
        """
        temp = self.blobs.new_temp()
        try:
            async for chunk in chunks:
                if temp.size + len(chunk) > max_size:
                    raise PayloadTooLarge(f"{key}: the body is over the {max_size}-byte limit")
                await temp.write(chunk)
            sha256 = await self.blobs.publish(temp)
        except BaseException:
            temp.discard()
            raise
        stored_at = now_ms()
        entry = Entry(
            repository=repository,
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
        await self.catalog.put_entry(entry)
        return entry

    async def record_links(self, links: Sequence[Link]) -> None:
        await self.catalog.put_links(links)

    async def find_link(self, repository: str, key: str) -> Link | None:
        return await self.catalog.get_link(repository, key)

    async def render_entry(
        self,
        entry: Entry,
        method: str,
        request_headers: Mapping[str, str],
        extra: Mapping[str, str],
    ) -> Response:
        """Serve a stored entry as is; raises FileNotFoundError if its blob is gone."""
        return await responses.blob(
            request_headers, method, entry, self.path_of(entry), self.hot, extra
        )

    def path_of(self, entry: Entry) -> str:
        assert entry.sha256 is not None
        return self.blobs.path_str(entry.sha256)

    async def forget(self, entry: Entry) -> None:
        self.index.drop(entry.repository, entry.key)
        try:
            await self.catalog.delete_entry(entry.repository, entry.key, entry.sha256)
        except CatalogError as exc:
            log.warning(
                "could not forget repository=%s key=%s: %s", entry.repository, entry.key, exc
            )


CHECKSUM_HEADER_DIGESTS = ("sha1", "md5", "sha256")


def checksum_headers_of(entry: Entry) -> dict[str, str]:
    """``X-Checksum-Sha1`` and friends: only digests we computed from these very bytes."""
    return {
        f"x-checksum-{name}": entry.digests[name]
        for name in CHECKSUM_HEADER_DIGESTS
        if name in entry.digests
    }

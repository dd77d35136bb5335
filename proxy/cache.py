"""The cache layer formats talk to: look a key up, serve it, or fetch it.

Formats never touch SQL or files: they describe a key with a ``FetchSpec`` and get an
ASGI response back from ``Cache.respond``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from proxy import metrics, responses
from proxy.blobs import BlobStore
from proxy.catalog import Catalog, Entry, Link
from proxy.entry_index import AccessLog, EntryIndex
from proxy.exceptions import CatalogError, NotFound
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
    ) -> Response:
        """Serve ``spec.key``: from the cache if fresh, else through the miss path."""
        extra = dict(extra_headers or {})
        for _attempt in range(2):
            outcome = await self.get(spec)
            try:
                return self.render(outcome, method, request_headers, extra, spec.repository)
            except FileNotFoundError:
                # The blob went away under the entry (evicted by another replica, or
                # removed by hand): forget the entry and go through the miss path once.
                assert isinstance(outcome, Stored | Stale)
                await self.forget(outcome.entry)
        raise NotFound(f"{spec.key}: the cached file disappeared twice; try again")

    def render(
        self,
        outcome: Outcome,
        method: str,
        request_headers: Mapping[str, str],
        extra: dict[str, str],
        repository: str,
    ) -> Response:
        if isinstance(outcome, Stored):
            return responses.blob(
                request_headers, method, outcome.entry, self.path_of(outcome.entry), self.hot, extra
            )
        if isinstance(outcome, Stale):
            extra = {**extra, "warning": '110 - "Response is Stale"'}
            return responses.blob(
                request_headers, method, outcome.entry, self.path_of(outcome.entry), self.hot, extra
            )
        if isinstance(outcome, Streaming):
            return responses.downloading(method, outcome.download, extra, repository)
        if isinstance(outcome, Inline):
            return responses.inline(
                request_headers, method, outcome.body, outcome.content_type, extra, repository
            )
        raise NotFound(outcome.message)

    async def record_links(self, links: Sequence[Link]) -> None:
        await self.catalog.put_links(links)

    async def find_link(self, repository: str, key: str) -> Link | None:
        return await self.catalog.get_link(repository, key)

    def path_of(self, entry: Entry) -> str:
        assert entry.sha256 is not None
        return str(self.blobs.path(entry.sha256))

    async def forget(self, entry: Entry) -> None:
        self.index.drop(entry.repository, entry.key)
        try:
            await self.catalog.delete_entry(entry.repository, entry.key, entry.sha256)
        except CatalogError as exc:
            log.warning(
                "could not forget repository=%s key=%s: %s", entry.repository, entry.key, exc
            )

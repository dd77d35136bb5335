"""A hosted repository's view of the cache (``contract.HostedCache``): what clients
upload is stored durably and served back; nothing is fetched from an upstream.

The engine counts uploads, not the format: ``CountedUploads`` wraps a hosted
repository's adapter and counts every upload it refuses (by the exception it raises),
``HostedView.store`` every one it stores (``proxy_uploads_total``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from proxy.cache import Cache
from proxy.catalog import Entry
from proxy.contract import Adapter, Request, Response
from proxy.exceptions import Forbidden, NotFound, PayloadTooLarge, Unauthorized
from proxy.http.access_log import note_outcome
from proxy.runtime import metrics
from proxy.types import Kind

UPLOAD_METHODS = frozenset({"PUT", "POST"})
# The outcome an upload refused with each exception is counted as.
REFUSALS: tuple[tuple[type[Exception], str], ...] = (
    (Unauthorized, "unauthorized"),
    (Forbidden, "forbidden"),
    (PayloadTooLarge, "too_large"),
)


class HostedView:
    """``contract.HostedCache`` for one repository."""

    def __init__(self, cache: Cache, name: str, format_name: str) -> None:
        self.cache = cache
        self.name = name
        self.format = format_name
        # Reads since this process started (the heartbeat carries them); uploads are
        # no misses.
        self.hits = 0
        self.misses = 0

    async def store(
        self, key: str, body: AsyncIterator[bytes], max_size: int, content_type: str | None
    ) -> None:
        cache = self.cache
        temp = await cache.storage.files.new_temp()
        try:
            async for chunk in body:
                if temp.size + len(chunk) > max_size:
                    raise PayloadTooLarge(f"{key}: the body is over the {max_size}-byte limit")
                await temp.write(chunk)
            sha256 = await cache.storage.publish(temp)
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
        metrics.UPLOADS.labels(self.name, "stored").inc()
        note_outcome("upload")

    async def serve(self, key: str, request: Request, content_type: str) -> Response:
        entry = await self.cache.lookup(self.name, key)
        if entry is None or entry.kind is not Kind.HOSTED:
            raise NotFound(f"no entry {key}")
        if request.method == "GET":
            # Only a read is a use; a HEAD probe must not keep an entry from eviction.
            self.cache.access.record(self.name, key)
        metrics.CACHE_HITS.labels(self.name, self.format, Kind.HOSTED.value).inc()
        self.hits += 1
        note_outcome("hit")
        try:
            return await self.cache.render_entry(entry, request, {"content-type": content_type})
        except FileNotFoundError:
            await self.cache.forget(entry)
            raise NotFound(f"no entry {key}") from None


class CountedUploads:
    """A hosted repository's adapter, with every refused upload counted by outcome."""

    def __init__(self, adapter: Adapter, repository: str) -> None:
        self.adapter = adapter
        self.repository = repository

    async def handle(self, request: Request) -> Response:
        try:
            return await self.adapter.handle(request)
        except Exception as exc:
            if request.method in UPLOAD_METHODS:
                for refusal, outcome in REFUSALS:
                    if isinstance(exc, refusal):
                        metrics.UPLOADS.labels(self.repository, outcome).inc()
                        break
            raise

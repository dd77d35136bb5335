"""A proxying repository's view of the cache: ``contract.ProxyCache``.

A key is served from the cache when it is fresh, else through the miss path
(``fetch.fetcher``); every request for a key, GET or HEAD, takes the same path, so
freshness, single flight, leases and negative entries are decided here for every
format (docs/architecture.md, "The request path of a hit", "... of a miss").
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Mapping

from proxy.cache import Cache
from proxy.catalog import Catalog, Entry
from proxy.config.settings import DEFAULT_MAX_FILE_SIZE
from proxy.contract import (
    FetchSpec,
    OriginContext,
    PackageVersion,
    Request,
    Response,
    UpstreamClient,
    WarmResult,
)
from proxy.exceptions import NotFound, RetryLater, StorageError, UpstreamError
from proxy.fetch.fetcher import Inline, Miss, Missing, Outcome, Stale, Stored, Streaming
from proxy.http import responses
from proxy.http.access_log import note_outcome
from proxy.runtime import metrics
from proxy.runtime.blocking import CpuPool, run_blocking
from proxy.types import Digests, Kind, Link, LinkBatch


class CatalogLinks:
    """The ``LinkStore`` of one repository, kept in the catalog."""

    def __init__(self, catalog: Catalog, repository: str) -> None:
        self.catalog = catalog
        self.repository = repository

    async def record(self, links: Iterable[Link] | LinkBatch) -> None:
        if not isinstance(links, LinkBatch):
            links = list(links)
            named = {link.repository for link in links}
        else:
            named = set(links.repositories)
        if named - {self.repository}:
            raise ValueError(
                f"links recorded for {self.repository!r} name another repository: "
                f"{', '.join(sorted(named - {self.repository}))}"
            )
        await self.catalog.put_links(links)

    async def get(self, key: str) -> Link | None:
        return await self.catalog.get_link(self.repository, key)


class ProxiedView:
    """``contract.ProxyCache`` for one repository."""

    def __init__(
        self,
        cache: Cache,
        name: str,
        format_name: str,
        upstream: UpstreamClient,
        cpu: CpuPool,
        max_file_size: int = DEFAULT_MAX_FILE_SIZE,
        package_of: Callable[[str], PackageVersion | None] | None = None,
    ) -> None:
        self.cache = cache
        self.name = name
        self.format = format_name
        self.max_file_size = max_file_size
        self.package_of = package_of
        # Since this process started; every replica's heartbeat carries them, and the
        # console sums them over the fleet (proxy/fleet.py).
        self.hits = 0
        self.misses = 0
        self.links = CatalogLinks(cache.catalog, name)
        self.origin_context = OriginContext(
            upstream=upstream, links=self.links, get=self.warm, compute=cpu.run
        )

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
        self.hits += 1
        note_outcome("hit")
        self.cache.access.record(self.name, spec.key)
        return Stored(entry)

    async def _miss(self, spec: FetchSpec, entry: Entry | None) -> Outcome:
        """Fetch a key with no fresh entry (``entry``: the expired one, if any)."""
        metrics.CACHE_MISSES.labels(self.name, self.format, spec.kind.value).inc()
        self.misses += 1
        note_outcome("miss")
        stale = entry if entry is not None and entry.kind is Kind.METADATA else None
        return await self._fetch(spec, stale)

    async def _fetch(self, spec: FetchSpec, stale: Entry | None) -> Outcome:
        miss = Miss(
            self.name, self.format, spec, self.origin_context, self.max_file_size, self.package_of
        )
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
            raise RetryLater(f"{spec.key}: {unrecorded}; retry")
        return entry

    async def respond(
        self,
        spec: FetchSpec,
        request: Request,
        headers: Mapping[str, str] | None = None,
        digest_headers: Callable[[Digests], Mapping[str, str]] | None = None,
    ) -> Response:
        extra = dict(headers or {})
        outcome, _hit = await self._outcome(spec)
        for attempt in (1, 2):
            answer_headers = extra
            # Digests are of the stored bytes: a body with base-URL marks is sent
            # otherwise, so it gets none (they would not be the digests of what it sends).
            if isinstance(outcome, Stored | Stale) and digest_headers and not spec.base_url_marks:
                answer_headers = {**extra, **digest_headers(outcome.entry.digests)}
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
        # A body naming the proxy gets the URL this client reaches us at, never stored.
        base_url = request.base_url if spec.base_url_marks else None
        if isinstance(outcome, Stored):
            return await self.cache.render_entry(outcome.entry, request, extra, base_url)
        if isinstance(outcome, Stale):
            note_outcome("stale")
            # Expired: say so, and let no cache keep it.
            extra = {**extra, "warning": '110 - "Response is Stale"', "cache-control": "no-cache"}
            return await self.cache.render_entry(outcome.entry, request, extra, base_url)
        if isinstance(outcome, Streaming):
            if outcome.transfer.verified() or base_url is not None:
                # Only storing remains (fsync, catalog): a request that comes now is
                # answered as the stored entry (ETag, Range, 304), like right after. A
                # body with marks is always answered so: its marks must be filled in.
                entry = await outcome.transfer.result()
                if entry is not None:
                    with contextlib.suppress(FileNotFoundError):
                        return await self.cache.render_entry(entry, request, extra, base_url)
                if base_url is not None:
                    raise RetryLater(f"{spec.key}: stored but not recorded; retry")
            now_ms = self.cache.clock.now_ms()
            expires_at_ms = spec.expires_at_ms(now_ms)
            max_age_s = None if expires_at_ms is None else (expires_at_ms - now_ms) // 1000
            policy = responses.cache_control(spec.kind, max_age_s)
            return responses.downloading(request.method, outcome.transfer, extra, self.name, policy)
        if isinstance(outcome, Inline):
            body = outcome.body
            if base_url is not None:
                body = body.replace(responses.MARK, base_url.encode("ascii"))
            return responses.inline(
                request.headers, request.method, body, outcome.content_type, extra, self.name
            )
        raise NotFound(outcome.message)

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
            # Never stored (TTL 0), so computed now: the digests a stored copy keeps.
            return await run_blocking(_digests_of, outcome.body, ("sha256", *spec.digests))
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
                    body = await self.cache.body(entry).read_all()
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


def _digests_of(body: bytes, names: Iterable[str]) -> Digests:
    return {name: hashlib.new(name, body).hexdigest() for name in dict.fromkeys(names)}

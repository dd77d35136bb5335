"""A proxying repository's view of the cache: ``contract.ProxyCache``.

A key is served from the cache when it is fresh, else through the miss path
(``fetch.fetcher``); every request for a key, GET or HEAD, takes the same path, so
freshness, single flight, leases and negative entries are decided here for every
format (docs/architecture.md, "The request path of a hit", "... of a miss").
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from proxy.cache import Cache
from proxy.cache.documents import Documents, Judged, Listed, Rendering
from proxy.catalog import Catalog, Entry
from proxy.config.settings import DEFAULT_MAX_FILE_SIZE
from proxy.contract import (
    FetchSpec,
    OriginContext,
    PackageVersion,
    Request,
    Response,
    UpstreamClient,
    View,
    WarmResult,
)
from proxy.exceptions import NotFound, RetryLater, StorageError, UpstreamError
from proxy.fetch.fetcher import Inline, Miss, Missing, Outcome, Stale, Stored, Streaming
from proxy.http import lane, responses
from proxy.http.access_log import note_outcome
from proxy.http.bodies import MARK, FileBody
from proxy.policy.gate import ReleaseGate
from proxy.runtime import metrics
from proxy.runtime.blocking import CpuPool, run_blocking
from proxy.storage.integrity import Corruption
from proxy.types import Digests, Kind, Link, LinkBatch

log = logging.getLogger("proxy.cache")


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


@dataclass(frozen=True)
class _Copy:
    """The stored form of an index document being served: its blob, its entry (None
    for a body never stored, TTL 0, written as a blob only to be rendered) and whether
    it is a stale copy."""

    sha256: str
    size: int
    entry: Entry | None
    stale: bool = False


class ProxiedView:
    """``contract.ProxyCache`` for one repository; also where its release gate reads
    publish times (``policy.times.ReleaseSource``)."""

    def __init__(
        self,
        cache: Cache,
        name: str,
        format_name: str,
        upstream: UpstreamClient,
        cpu: CpuPool,
        documents: Documents,
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
        self.documents = documents
        self.gate: ReleaseGate | None = None  # the release policy, if the format has releases
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
        hits = metrics.CACHE_HITS.labels(self.name, self.format, entry.kind.value)
        hits.inc()
        self.count_hits(1)
        note_outcome("hit")
        self.cache.access.record(self.name, spec.key)
        # What every later hit answered by the hit lane does too (http/lane.py).
        lane.note_hit(
            self.cache.index.get(self.name, spec.key),
            entry,
            hits.inc,
            self.count_hits,
            functools.partial(self._accessed, spec.key),
        )
        return Stored(entry)

    def count_hits(self, n: int) -> None:
        self.hits += n

    def _accessed(self, key: str, _hits: int) -> None:
        self.cache.access.record(self.name, key)

    async def _miss(self, spec: FetchSpec, entry: Entry | None) -> Outcome:
        """Fetch a key with no fresh entry (``entry``: the expired one, if any)."""
        metrics.CACHE_MISSES.labels(self.name, self.format, spec.kind.value).inc()
        self.misses += 1
        note_outcome("miss")
        lane.spoil()
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
        representation: str = "",
    ) -> Response:
        # Before any answer (GET, HEAD, Range, 304, cached or not): a held or denied
        # release is refused on every path (docs/architecture.md, "Release policy").
        if self.gate is not None:
            await self.gate.check(spec.key)
        extra = dict(headers or {})
        if spec.model is not None:
            return await self._respond_document(
                spec, request, extra, representation, digest_headers
            )
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
        if base_url is not None or not isinstance(outcome, Stored):
            lane.spoil()  # the client's own URL in it, or no stored entry
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
                body = body.replace(MARK, base_url.encode("ascii"))
            return responses.inline(
                request.headers, request.method, body, outcome.content_type, extra, self.name
            )
        raise NotFound(outcome.message)

    async def served_digests(self, spec: FetchSpec, representation: str = "") -> Digests:
        if self.gate is not None:
            await self.gate.check(spec.key)
        if spec.model is not None:
            return await self._document_digests(spec, representation)
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

    async def read(self, spec: FetchSpec, limit: int, representation: str = "") -> bytes:
        if spec.model is not None and representation:
            return await self._read_document(spec, limit, representation)
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

    # -- index documents (docs/architecture.md, "Index documents") -------------------------

    async def _respond_document(
        self,
        spec: FetchSpec,
        request: Request,
        extra: dict[str, str],
        representation: str,
        digest_headers: Callable[[Digests], Mapping[str, str]] | None,
    ) -> Response:
        """An index document, rendered from its stored model as the policy says, fresh
        or stale alike, in the representation the adapter chose."""
        copy = await self._copy(spec, (await self._outcome(spec))[0])
        rendering, judged, copy = await self._rendered(spec, copy, representation)
        if judged.count is not None:
            judged.count(1)
            lane.note_each_hit(judged.count)
        lane.note_until(judged.until_ms)
        if copy.entry is None or copy.stale or rendering.marks:
            lane.spoil()
        for attempt in (1, 2):
            try:
                headers = extra
                if digest_headers is not None and not rendering.marks:
                    # The digests of the rendering: the very bytes sent (computed once).
                    digests = await rendering.digests(("sha256", *spec.digests))
                    headers = {**extra, **digest_headers(digests)}
                return await self._rendered_answer(spec, rendering, judged, copy, request, headers)
            except FileNotFoundError:
                if attempt == 2:
                    break
                # The rendering's file went (another process's renderings): render it again.
                self.documents.forget(self.name, copy.sha256, representation, judged)
                rendering, judged, copy = await self._rendered(spec, copy, representation)
        raise self._vanished(spec)

    async def _copy(self, spec: FetchSpec, outcome: Outcome) -> _Copy:
        if isinstance(outcome, Missing):
            raise NotFound(outcome.message)
        if isinstance(outcome, Inline):
            sha256 = await self.documents.keep(outcome.body)
            return _Copy(sha256, len(outcome.body), None)
        entry = await self._entry_of(spec, outcome, "stored but not recorded")
        assert entry.sha256 is not None
        return _Copy(entry.sha256, entry.size, entry, stale=isinstance(outcome, Stale))

    def _model_path(self, copy: _Copy) -> Callable[[], Awaitable[str]]:
        """Where a complete copy of the document's model is on this host, made on demand
        (object storage: filled into the local tier); FileNotFoundError if it is gone."""

        async def path() -> str:
            if copy.entry is None:
                return self.documents.path_of(copy.sha256)
            return await self.cache.body(copy.entry).complete_path()

        return path

    async def _rendered(
        self, spec: FetchSpec, copy: _Copy, representation: str
    ) -> tuple[Rendering, Judged, _Copy]:
        """What the document lists, what the policy decided for it, and its rendering,
        each kept by the stored body's sha256 (``cache/documents.py``); if the model's
        blob went away meanwhile, it is fetched again, once."""
        for attempt in (1, 2):
            try:
                return (*(await self._render_copy(spec, copy, representation)), copy)
            except FileNotFoundError:
                if attempt == 2 or copy.entry is None:
                    break
                copy = await self._copy(spec, await self._refetch(spec, copy.entry))
        raise self._vanished(spec)

    async def _render_copy(
        self, spec: FetchSpec, copy: _Copy, representation: str
    ) -> tuple[Rendering, Judged]:
        model = spec.model
        assert model is not None
        path = self._model_path(copy)
        listed = await self.documents.listed(self.name, model, copy.sha256, copy.size, path)
        gate = self.gate
        judge = gate.judge if gate is not None else _plain
        generation = gate.policies.current.generation if gate is not None else 0
        judged = await self.documents.judged(
            self.name, spec.key, listed, copy.sha256, judge, generation
        )
        rendering = self.documents.rendered(self.name, copy.sha256, representation, judged)
        if rendering is None:
            rendering = await self.documents.render(
                self.name, model, copy.sha256, copy.size, path, listed, judged, representation
            )
        return rendering, judged

    async def _rendered_answer(
        self,
        spec: FetchSpec,
        rendering: Rendering,
        judged: Judged,
        copy: _Copy,
        request: Request,
        extra: dict[str, str],
    ) -> Response:
        """Serve a rendering as a stored entry is served (ETag, 304, Range, HEAD), with
        the stored copy's Last-Modified and a max-age that never outlasts a hold it
        reflects. FileNotFoundError if its file is gone."""
        now_ms = self.cache.clock.now_ms()
        entry = copy.entry
        if entry is None:
            extra = {**extra, "cache-control": "no-cache"}  # never stored (TTL 0)
        elif copy.stale:
            note_outcome("stale")
            extra = {**extra, "warning": '110 - "Response is Stale"', "cache-control": "no-cache"}
        else:
            max_age_s = entry.max_age_s(now_ms)
            if judged.until_ms is not None:
                # A shared cache must not keep it past the end of a hold it reflects.
                max_age_s = max(0, min(max_age_s, (judged.until_ms - now_ms) // 1000))
            policy = responses.cache_control(Kind.METADATA, max_age_s)
            extra = {**extra, "cache-control": policy.decode()}
        served = Entry(
            repository=self.name,
            key=spec.key,
            kind=Kind.METADATA,
            sha256=rendering.sha256,
            size=rendering.size,
            content_type=entry.content_type if entry is not None else None,
            fetched_at_ms=entry.fetched_at_ms if entry is not None else now_ms,
            expires_at_ms=None,
            last_modified=entry.last_modified if entry is not None else None,
        )
        # Absolute URLs back to the proxy: the client's own, never stored.
        base_url = request.base_url if rendering.marks else None
        body = FileBody(
            self.cache.files, rendering.path, rendering.sha256, rendering.size,
            functools.partial(_drop_rendering, rendering.path),
        )  # fmt: skip
        return await self.cache.render_body(served, body, request, extra, base_url)

    async def _document_digests(self, spec: FetchSpec, representation: str) -> Digests:
        existing = await self.cache.lookup(self.name, spec.key, spec)
        if existing is not None and existing.sha256 is not None:
            # Expired or not: it is what clients were given.
            copy = _Copy(existing.sha256, existing.size, existing)
        else:
            copy = await self._copy(spec, (await self._outcome(spec))[0])
        rendering, judged, copy = await self._rendered(spec, copy, representation)
        try:
            return await rendering.digests(("sha256", *spec.digests))
        except FileNotFoundError:
            self.documents.forget(self.name, copy.sha256, representation, judged)
            rendering, judged, copy = await self._rendered(spec, copy, representation)
            return await rendering.digests(("sha256", *spec.digests))

    async def _read_document(self, spec: FetchSpec, limit: int, representation: str) -> bytes:
        copy = await self._copy(spec, (await self._outcome(spec))[0])
        rendering, judged, copy = await self._rendered(spec, copy, representation)
        lane.note_until(judged.until_ms)  # an answer made of it changes when a hold ends
        if copy.stale:
            lane.spoil()
        if rendering.size > limit:
            raise UpstreamError(f"{spec.key}: {rendering.size} bytes, over {limit}")
        try:
            return await rendering.read()
        except FileNotFoundError:
            self.documents.forget(self.name, copy.sha256, representation, judged)
            rendering, judged, copy = await self._rendered(spec, copy, representation)
            return await rendering.read()

    # -- what the release gate reads (policy.times.ReleaseSource) ------------------------

    async def listed(self, spec: FetchSpec, refresh: bool = False) -> Listed | None:
        assert spec.model is not None
        entry = None if refresh else await self.cache.lookup(self.name, spec.key, spec)
        if entry is not None and entry.kind is Kind.METADATA and entry.sha256 is not None:
            copy = _Copy(entry.sha256, entry.size, entry)  # a stale copy tells times too
        else:
            outcome, _hit = await self._outcome(spec)
            if isinstance(outcome, Missing):
                return None
            copy = await self._copy(spec, outcome)
        for attempt in (1, 2):
            try:
                return await self.documents.listed(
                    self.name, spec.model, copy.sha256, copy.size, self._model_path(copy)
                )
            except FileNotFoundError:
                if attempt == 2 or copy.entry is None:
                    break
                copy = await self._copy(spec, await self._refetch(spec, copy.entry))
        raise self._vanished(spec)

    async def stored(self, spec: FetchSpec) -> Entry | None:
        outcome, _hit = await self._outcome(spec)
        if isinstance(outcome, Missing | Inline):
            return None
        return await self._entry_of(spec, outcome, "stored but not recorded")


async def _plain(key: str, listed: Listed) -> Judged:
    """The judgement of a document where no policy applies: nothing withheld."""
    return Judged(View(), "")


def _digests_of(body: bytes, names: Iterable[str]) -> Digests:
    return {name: hashlib.new(name, body).hexdigest() for name in dict.fromkeys(names)}


async def _drop_rendering(path: str, found: Corruption) -> None:
    """A rendering found corrupt (docs/architecture.md, "Blobs verified when read"): it is
    this host's own file, made from the stored document, so it is removed and rendered
    again; no entry names it, so nothing is quarantined."""
    log.error("rendering %s is corrupt (%s): removed, rendered again", path, found.describe())
    with contextlib.suppress(FileNotFoundError):
        await run_blocking(os.unlink, path)

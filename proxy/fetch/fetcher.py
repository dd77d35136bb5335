"""The miss path (docs/architecture.md, "The request path of a miss"): single flight in
the process, a fetch lease across processes, and a download every waiter reads while
it arrives.

``Fetcher.fetch(miss, stale)`` returns an ``Outcome`` as soon as a client can start
answering: ``Streaming`` once the first bytes are on disk, or the final result. The
fetch itself runs in the app's task group, so a client that leaves cancels only its
own wait, never the fetch nor the other clients joined to it.

Formats describe *how* to get a key from upstream with an ``Origin``; this module
decides *whether* to (lease), and stores, verifies and streams what arrives.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from proxy.catalog import Catalog, Entry, StreamInfo
from proxy.clock import Clock
from proxy.config.settings import DEFAULT_MAX_FILE_SIZE
from proxy.contract import Fetched, FetchSpec, OriginContext, PackageVersion, Status
from proxy.exceptions import (
    CatalogError,
    ContentMismatch,
    DigestMismatch,
    FetchError,
    ProxyError,
    ShuttingDown,
    StorageError,
    StorageFull,
    TransferCut,
    UpstreamError,
    UpstreamUnavailable,
)
from proxy.fetch.content import HEAD_BYTES as CONTENT_HEAD_BYTES
from proxy.fetch.content import head_problem
from proxy.fetch.content import problem as content_problem
from proxy.fetch.download import Download
from proxy.fetch.index import EntryIndex
from proxy.fetch.leases import HeldLease, LeaseCoordinator, Verdict
from proxy.fetch.relay import RelayServer
from proxy.fetch.relayed import RelayClient
from proxy.fetch.transfer import LocalFile, SharedFile, Source, StoredBlob, Transfer
from proxy.redaction import redact
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.runtime.tasks import TaskSupervisor
from proxy.storage.blobs import room_problem, storage_error
from proxy.storage.store import Storage
from proxy.types import KNOWN_DIGESTS, Kind, Validators
from proxy.upstream.client import traced

log = logging.getLogger("proxy.fetch")

INLINE_BODY_LIMIT_BYTES = 64 * 1024 * 1024  # bodies never stored (TTL 0) are held in memory
_TEMP_NAME_RE = re.compile(r"[0-9a-f]{32}\.part")


def under_current_ttl(entry: Entry, spec: FetchSpec) -> Entry:
    """``entry`` with the expiry today's settings give it: stored metadata and negative
    entries are fresh for the current ``metadata_ttl``/``negative_ttl`` from when they
    were fetched, not for the TTL they were stored under, so a changed TTL governs what
    is stored at once (freshness, and the max-age clients are told). A file stored as
    immutable whose key the settings now make metadata (a raw repository's new
    ``mutable`` glob) is metadata from when it was fetched: else it stayed for ever."""
    if entry.kind is Kind.IMMUTABLE and spec.kind is Kind.METADATA and spec.ttl_s is not None:
        expires_at_ms = entry.fetched_at_ms + int(spec.ttl_s * 1000)
        return replace(entry, kind=Kind.METADATA, expires_at_ms=expires_at_ms)
    if entry.kind is Kind.METADATA and spec.ttl_s is not None:
        expires_at_ms = entry.fetched_at_ms + int(spec.ttl_s * 1000)
    elif entry.kind is Kind.NEGATIVE:
        expires_at_ms = entry.fetched_at_ms + int(spec.negative_ttl_s * 1000)
    else:
        return entry
    if expires_at_ms == entry.expires_at_ms:
        return entry
    return replace(entry, expires_at_ms=expires_at_ms)


@dataclass(frozen=True)
class Miss:
    """One key of one repository to get from upstream, and what its origin may use."""

    repository: str
    format: str
    spec: FetchSpec
    context: OriginContext
    max_size: int = DEFAULT_MAX_FILE_SIZE  # repositories.<name>.max_file_size
    package_of: Callable[[str], PackageVersion | None] | None = None  # the format's

    @property
    def key(self) -> str:
        return self.spec.key

    def package(self) -> PackageVersion | None:
        """The package the key belongs to, as its format says (never fails a store)."""
        if self.package_of is None:
            return None
        try:
            return self.package_of(self.key)
        except Exception as exc:
            log.error("package_of(%r) of %s failed: %r", self.key, self.format, exc)
            return None


# -- outcomes: what a waiting request gets ---------------------------------------------


@dataclass(frozen=True)
class Stored:
    entry: Entry


@dataclass(frozen=True)
class Streaming:
    transfer: Transfer


@dataclass(frozen=True)
class Inline:
    body: bytes
    content_type: str | None


@dataclass(frozen=True)
class Missing:
    message: str


@dataclass(frozen=True)
class Stale:
    entry: Entry
    reason: str


Outcome = Stored | Streaming | Inline | Missing | Stale
# (sha256, size, content type) -> a source of the stored body from its first byte.
OpenStored = Callable[[str, int, str | None], Awaitable[Source]]


class _Flight:
    """One fetch of one key in this process, and the requests waiting on it."""

    def __init__(self) -> None:
        self.answer: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.download: Download | None = None  # ours, when we download it
        self.transfer: Transfer | None = None  # what our clients read, once streaming
        self.outcome: Outcome | None = None
        self.published: StoredBlob | None = None  # our verified blob
        self.requests = 1  # requests that asked for it while it ran (the first included)

    def progress(self) -> tuple[int, int]:
        """Bytes of our download on disk, and the requests sharing it (lease renewals
        report them: docs/architecture.md, "Operating: console, API and logs")."""
        return (self.download.written if self.download is not None else 0), self.requests

    def settle(self, outcome: Outcome) -> None:
        self.outcome = outcome  # what it came to, even when clients already stream
        if not self.answer.done():
            self.answer.set_result(outcome)

    def stream(self, transfer: Transfer) -> None:
        """Requests from now on read ``transfer``: the first one, or the successor that
        carries a changed body on (those before it were cut)."""
        self.transfer = transfer
        if self.answer.done():
            self.answer = asyncio.get_running_loop().create_future()
        self.answer.set_result(Streaming(transfer))

    def settle_error(self, exc: BaseException) -> None:
        if self.download is not None:
            self.download.fail(exc)
        if self.transfer is not None:
            self.transfer.fail(exc)
        if not self.answer.done():
            self.answer.set_exception(exc)
            # Retrieved here: when every waiter has left (a client gone, a mirror run
            # cancelled), nobody would, and asyncio would log it as lost at exit.
            self.answer.exception()


class Fetcher:
    def __init__(
        self,
        catalog: Catalog,
        storage: Storage,
        index: EntryIndex,
        leases: LeaseCoordinator,
        tasks: TaskSupervisor,
        clock: Clock,
        open_stored: OpenStored | None = None,
        relay: RelayServer | None = None,
        relays: RelayClient | None = None,
        min_free: int = 0,
    ) -> None:
        """``open_stored``: how a stored blob is read here from its first byte (object
        storage: the local tier's copy, or the object as it arrives); the folder store
        opens its file. ``relay`` serves our downloads to other replicas, ``relays``
        follows theirs, when the storage shares no temp files. ``min_free``: the free
        space (``storage.min_free``) a download may not take the storage under."""
        self.min_free = min_free
        self._making_room = asyncio.Lock()
        self.catalog = catalog
        self.storage = storage
        self.open_stored = open_stored or self._open_file
        self.relay = relay
        self.relays = relays
        self.index = index
        self.leases = leases
        self.tasks = tasks
        self.clock = clock
        self._flights: dict[tuple[str, str], _Flight] = {}

    async def fetch(self, miss: Miss, stale: Entry | None) -> Outcome:
        """Join the fetch of ``miss.key`` running in this process, or start one."""
        flight_key = (miss.repository, miss.key)
        flight = self._flights.get(flight_key)
        if flight is not None:
            metrics.COALESCED_WAITERS.labels(repository=miss.repository).inc()
            flight.requests += 1
        else:
            if self.tasks.closing:
                raise ShuttingDown("the proxy is shutting down")
            flight = _Flight()
            self._flights[flight_key] = flight
            self.tasks.spawn(
                f"fetch:{miss.repository}/{miss.key}", self._run(miss, stale, flight, flight_key)
            )
        # shield: a client that leaves cancels its own wait, not the shared future.
        return await asyncio.shield(flight.answer)

    async def _run(
        self, miss: Miss, stale: Entry | None, flight: _Flight, flight_key: tuple[str, str]
    ) -> None:
        gauge = metrics.FETCHES_IN_FLIGHT.labels(repository=miss.repository)
        gauge.inc()
        try:
            await self._resolve(miss, stale, flight)
            await self._conclude(miss, flight)
        except asyncio.CancelledError:
            flight.settle_error(ShuttingDown("the proxy is shutting down"))
            raise
        except (StorageError, CatalogError) as exc:
            # Upstream failures are logged where they happen; ours are logged here, once,
            # by name (e.g. ENOSPC), for the operator.
            level = logging.WARNING if isinstance(exc, StorageFull) else logging.ERROR
            log.log(level, "fetch failed repository=%s key=%s: %s", miss.repository, miss.key, exc)
            flight.settle_error(exc)
        except Exception as exc:
            if not isinstance(exc, ProxyError):
                log.error(
                    "fetch failed repository=%s key=%s", miss.repository, miss.key, exc_info=exc
                )
            if isinstance(exc, OSError):  # a blob gone under us, ESTALE: a 503 that says so
                exc = storage_error(f"fetching {miss.key}", "read", exc)
            flight.settle_error(exc)
        finally:
            gauge.dec()
            if self._flights.get(flight_key) is flight:
                del self._flights[flight_key]
            if flight.transfer is not None and not flight.transfer.concluded():
                # Not reached when _conclude did its work; a last guard so that no client
                # of this flight ever waits for a source nobody will give it.
                flight.transfer.fail(TransferCut(f"{miss.key}: the fetch ended"))

    async def _resolve(self, miss: Miss, stale: Entry | None, flight: _Flight) -> None:
        if not miss.spec.storable:
            # Never stored, so nothing for another process to wait for: no lease.
            await self._download(miss, stale, flight, held=None)
            return
        took_over = False
        unrenewed: tuple[int, float] | None = None
        while True:
            # The first claim refuses a key stored since our lookup: the wait finds it.
            held = await self.leases.claim(
                miss.repository, miss.key, unless_stored=not took_over, unrenewed=unrenewed
            )
            if held is not None:
                held.progress = flight.progress
                if took_over:
                    metrics.LEASE_TAKEOVERS.labels(repository=miss.repository).inc()
                await self._download(miss, stale, flight, held)
                return
            metrics.LEASE_WAITS.labels(repository=miss.repository).inc()
            # Whatever file the holder announces, our clients read as it grows, while
            # the wait goes on for the outcome.
            result = await self.leases.wait(
                miss.repository,
                miss.key,
                lambda: self._find_fresh(miss),
                lambda stream, fence: self._follow(miss, flight, stream, fence),
            )
            if result.verdict is Verdict.ENTRY:
                entry = result.entry
                assert entry is not None
                self.index.put(entry)
                flight.settle(_served(entry))
                return
            if result.verdict is Verdict.FAILED:
                if flight.transfer is not None:
                    # Our clients were reading that replica's download: it failed (say, a
                    # digest mismatch), so theirs end short, as the holder's own do.
                    flight.transfer.fail(
                        TransferCut(f"{miss.key}: the download by another replica failed")
                    )
                    return
                if stale is not None:
                    reason = f"the fetch by another process failed (fence {result.fence})"
                    self._serve_stale(miss, stale, reason, flight)
                    return
                # Nothing to fall back on: fetch at the same time as the others, unleased.
                await self._download(miss, stale, flight, held=None)
                return
            log.info(
                "lease takeover repository=%s key=%s after fence=%s",
                miss.repository,
                miss.key,
                result.fence,
            )
            if flight.transfer is not None:
                flight.transfer.lost()  # our clients wait for the next download
            took_over = True
            unrenewed = result.unrenewed

    async def _conclude(self, miss: Miss, flight: _Flight) -> None:
        """End the transfer our clients read in agreement with what the fetch came to,
        whichever way it got there: an entry stored by us or found (the holder stored it
        as we claimed), a stale copy, a 404 or 304 from the upstream on a takeover. Left
        alone, its readers would wait for a source forever. A stale copy does not
        continue them: their headers promised a fresh body; they are cut, and a retry
        gets the stale answer with its warning."""
        # A switch may hand a changed body on to a successor while ``stored`` awaits:
        # conclude whichever transfer the flight ends up with.
        while (transfer := flight.transfer) is not None and not transfer.concluded():
            outcome = flight.outcome
            entry = outcome.entry if isinstance(outcome, Stored) else None
            if entry is not None and entry.sha256 is not None:
                blob = self.stored_blob(entry.sha256, entry.size, entry.content_type)
                await transfer.stored(blob, entry)
            elif flight.published is not None:  # verified and kept, but not recorded
                await transfer.stored(flight.published, None)
            else:
                transfer.fail(
                    TransferCut(f"{miss.key}: the fetch ended without the body being read")
                )

    def stored_blob(self, sha256: str, size: int, content_type: str | None) -> StoredBlob:
        async def open_blob() -> Source:
            return await self.open_stored(sha256, size, content_type)

        return StoredBlob(sha256, size, self.storage.blob_path(sha256), open_blob)

    async def _open_file(self, sha256: str, size: int, content_type: str | None) -> Source:
        path = self.storage.blob_path(sha256)
        return await SharedFile.open(path, content_type, size, self.tasks.spawn, complete=True)

    async def _follow(self, miss: Miss, flight: _Flight, stream: StreamInfo, fence: int) -> None:
        """Serve our clients from the file another replica announced, or its relay."""
        if not miss.spec.stream:
            return
        if stream.relay is not None and self.relays is not None:
            relayed = await self.relays.follow(stream, fence, self.tasks.spawn)
            if relayed is not None:
                self._attach(flight, relayed)
            return
        if stream.file is None or not self.storage.shares_temp_files:
            return  # nothing here can read it: the entry will do
        path = str(self.storage.files.tmp_dir / stream.file)
        if not _is_plain_name(stream.file):
            log.warning("ignoring a stream announcement naming %r", stream.file)
            return
        try:
            source = await SharedFile.open(
                path, stream.content_type, stream.length, self.tasks.spawn, complete=False
            )
        except OSError as exc:
            # Finished and renamed already, or not visible here: the entry will do.
            log.debug("announced download %s not readable here: %s", path, exc)
            return
        self._attach(flight, source)

    def _attach(self, flight: _Flight, source: Source) -> None:
        """Give our clients ``source``: the first one starts their answers; a later one
        takes over from a source that was lost, once proven to start the same way."""
        if flight.transfer is None or flight.transfer.concluded():
            # The first source, or one after the last transfer failed (its clients were
            # cut): requests from now on read the new one.
            flight.stream(Transfer(source, self.tasks.spawn, on_changed=flight.stream))
        else:
            flight.transfer.replace(source)

    async def _find_fresh(self, miss: Miss) -> Entry | None:
        entry = await self.catalog.get_entry(miss.repository, miss.key)
        if entry is None:
            return None
        entry = under_current_ttl(entry, miss.spec)
        return entry if entry.is_fresh(self.clock.now_ms()) else None

    def _serve_stale(self, miss: Miss, stale: Entry, reason: str, flight: _Flight) -> None:
        metrics.STALE_SERVED.labels(repository=miss.repository).inc()
        log.warning(
            "serving stale repository=%s key=%s age=%.0fs reason=%s",
            miss.repository,
            miss.key,
            (self.clock.now_ms() - stale.fetched_at_ms) / 1000,
            reason,
        )
        flight.settle(Stale(stale, reason))

    async def _download(
        self, miss: Miss, stale: Entry | None, flight: _Flight, held: HeldLease | None
    ) -> None:
        spec = miss.spec
        started = self.clock.monotonic()
        state = "released"
        outcome = "error"
        validators = Validators(stale.etag, stale.last_modified) if stale is not None else None
        with traced() as urls:
            try:
                async with spec.origin.open(miss.context, validators) as fetched:
                    if fetched.status is Status.NOT_MODIFIED and stale is not None:
                        fetched_at = self.clock.now_ms()
                        entry = stale.refreshed(
                            fetched_at,
                            spec.expires_at_ms(fetched_at),
                            fetched.validators.etag,
                            fetched.validators.last_modified,
                        )
                        await self.catalog.refresh_entry(entry)
                        self.index.put(entry)
                        flight.settle(Stored(entry))
                        outcome = "not_modified"
                    elif fetched.status is Status.NOT_MODIFIED:
                        raise UpstreamUnavailable(
                            f"{spec.key}: upstream answered 304 to an unconditional GET"
                        )
                    elif fetched.status is Status.NOT_FOUND:
                        await self._store_negative(miss)
                        flight.settle(Missing(fetched.message or f"{spec.key} not found upstream"))
                        outcome = "not_found"
                    elif not spec.storable:
                        body = await _read_all(fetched)
                        flight.settle(Inline(body, fetched.content_type))
                        outcome = "passed_through"
                    else:
                        await self._store_body(miss, fetched, flight, held, urls)
                        outcome = "stored"
                state = "done"
            except StorageFull as exc:
                # Released, not failed: a waiter that claims it next checks the room it
                # has (a replica's own disk, on object storage) before it reads a body.
                outcome = "storage_full"
                if stale is not None and stale.kind is Kind.METADATA:
                    self._serve_stale(miss, stale, str(exc), flight)
                else:
                    raise
            except FetchError as exc:
                state = "failed"
                if isinstance(exc, DigestMismatch):
                    metrics.DIGEST_MISMATCHES.labels(repository=miss.repository).inc()
                elif isinstance(exc, ContentMismatch):
                    metrics.CONTENT_REFUSED.labels(repository=miss.repository).inc()
                log.warning(
                    "fetch failed repository=%s key=%s error=%s", miss.repository, spec.key, exc
                )
                if stale is not None and stale.kind is Kind.METADATA:
                    self._serve_stale(miss, stale, str(exc), flight)
                else:
                    raise
            finally:
                metrics.UPSTREAM_FETCH_DURATION.labels(
                    repository=miss.repository, outcome=outcome
                ).observe(self.clock.monotonic() - started)
                if held is not None:
                    await held.release(state)
        log.info(
            "fetch repository=%s key=%s outcome=%s duration=%.3fs lease=%s upstream=%s",
            miss.repository,
            spec.key,
            outcome,
            self.clock.monotonic() - started,
            held.fence if held else "none",
            redact(urls[-1]) if urls else "-",
        )

    async def _check_room(self, spec: FetchSpec, incoming: int) -> None:
        """``StorageFull`` if a download of ``incoming`` bytes (0: not announced) would
        leave the disk its temp files are on under ``storage.min_free``, after the store
        made what room it can (docs/architecture.md, "Storage faults"). Asked once the
        upstream has answered 200, before its body is read: a 404 or a 304 still needs
        no room. Without it, on a full disk every request for a missing file downloaded
        the body only to fail writing it, and so did each replica taking the lease over."""
        files = self.storage.files

        def shortfall(free: int | None) -> int:  # 0: room enough, or free space unknown
            return 0 if free is None else max(0, self.min_free + incoming - free)

        if not shortfall(await files.free_space()):
            return
        async with self._making_room:  # concurrent misses shed the shortfall once, not each
            free = await files.free_space()
            if shortfall(free):
                await self.storage.make_room(shortfall(free))
                free = await files.free_space()
        if free is None or not shortfall(free):
            return
        problem = room_problem(free, incoming, self.min_free)
        raise StorageFull(f"{spec.key}: the body was not fetched: {problem}")

    async def _store_negative(self, miss: Miss) -> None:
        spec = miss.spec
        if spec.negative_ttl_s <= 0 or not spec.storable:
            return
        fetched_at = self.clock.now_ms()
        package = miss.package()
        entry = Entry(
            repository=miss.repository,
            key=spec.key,
            kind=Kind.NEGATIVE,
            sha256=None,
            size=0,
            content_type=None,
            fetched_at_ms=fetched_at,
            expires_at_ms=fetched_at + int(spec.negative_ttl_s * 1000),
            package=package.package if package is not None else None,
            version=package.version if package is not None else None,
        )
        await self.catalog.put_entry(entry)
        self.index.put(entry)

    async def _store_body(
        self,
        miss: Miss,
        fetched: Fetched,
        flight: _Flight,
        held: HeldLease | None,
        urls: list[str],
    ) -> None:
        spec = miss.spec
        assert fetched.body is not None
        expected = {name: value.lower() for name, value in fetched.expected.items()}
        expected = {name: value for name, value in expected.items() if name in KNOWN_DIGESTS}
        wanted = set(spec.digests) | set(expected)
        if fetched.length is not None and fetched.length > miss.max_size:
            raise _too_large(miss, fetched.length)
        await self._check_room(spec, fetched.length or 0)
        temp = await self.storage.files.new_temp(wanted)
        download = Download(fetched.content_type, fetched.length)
        flight.download = download
        upstream_bytes = metrics.UPSTREAM_BYTES.labels(repository=miss.repository)
        streaming = False
        relayed: Transfer | None = None  # what our relay serves other replicas

        def progressed(written: int) -> None:
            nonlocal streaming, relayed
            if download.error is not None:
                return  # a write that finished after the fetch failed: nothing to offer
            download.advance_to(written)
            # Clients start on the first bytes when the length is known (they always get
            # a Content-Length), unless those bytes are the whole body: then verification
            # decides the answer (a clean 502 rather than a cut-off transfer).
            total = download.total
            if spec.stream and not streaming and total is not None and written < total:
                streaming = True
                self._attach(flight, LocalFile(download, temp.reader_fd()))
                if held is not None and self.storage.shares_temp_files:
                    # Other replicas' clients read the same file as it grows.
                    stream = StreamInfo(temp.path.name, download.content_type, total)
                    self.tasks.spawn(f"announce:{spec.key}", held.announce_stream(stream))
                elif held is not None and self.relay is not None:
                    # No shared volume: other replicas read it through our relay.
                    relayed = Transfer(LocalFile(download, temp.reader_fd()), self.tasks.spawn)
                    token = self.relay.offer(held.fence, relayed)
                    stream = StreamInfo(None, download.content_type, total, self.relay.url, token)
                    self.tasks.spawn(f"announce:{spec.key}", held.announce_stream(stream))

        temp.on_progress = progressed
        try:
            body = fetched.body
            if not expected and fetched.expected_later is None:
                # Nothing can verify these bytes: their first ones must already look
                # right, before any reaches a client (a clean 502, not a cut transfer).
                body = await _head_checked(body, spec)
            async for chunk in body:
                await temp.write(chunk)
                upstream_bytes.inc(len(chunk))
                if temp.size > miss.max_size:
                    raise _too_large(miss, temp.size)
            await temp.flush()
            if fetched.length is not None and temp.size != fetched.length:
                raise UpstreamUnavailable(
                    f"{spec.key}: upstream sent {temp.size} bytes, {fetched.length} expected"
                )
            computed = temp.digests()
            if fetched.expected_later is not None:
                later = await fetched.expected_later()
                expected.update({name: value.lower() for name, value in later.items()})
            for name, value in expected.items():
                if name in computed and computed[name] != value:
                    raise DigestMismatch(
                        f"{spec.key}: upstream bytes have {name} {computed[name]}, "
                        f"the upstream lists {value}; nothing was stored"
                    )
            if not any(name in computed for name in expected):
                # Nothing verified these bytes: they must look like what the key holds
                # (docs/architecture.md, "Content checks before storing").
                why = await run_blocking(content_problem, str(temp.path), spec.content)
                if why is not None:
                    raise _refused(spec, why)
            download.verify()  # the last byte may go out now, before our fsync
            sha256 = await self.storage.publish(temp)
            stored = self.stored_blob(sha256, temp.size, download.content_type)
            flight.published = stored
        except BaseException as exc:
            await temp.discard()
            error = exc if isinstance(exc, Exception) else ShuttingDown("shutting down")
            download.fail(error)
            if relayed is not None:
                self._end_relay(held, relayed)
                relayed.fail(error)
            raise
        fetched_at = self.clock.now_ms()
        package = miss.package()
        entry = Entry(
            repository=miss.repository,
            key=spec.key,
            kind=spec.kind,
            sha256=sha256,
            size=temp.size,
            content_type=fetched.content_type,
            fetched_at_ms=fetched_at,
            expires_at_ms=spec.expires_at_ms(fetched_at),
            etag=fetched.validators.etag,
            last_modified=fetched.validators.last_modified,
            digests=computed,
            last_access_ms=fetched_at,
            package=package.package if package is not None else None,
            version=package.version if package is not None else None,
            # The answer that carried the body is the last one opened (earlier ones
            # were other upstreams' 404s, or redirects' hops).
            upstream_url=urls[-1] if urls else None,
        )
        try:
            await self.catalog.put_entry(entry)
        except CatalogError as exc:
            # The bytes are verified and published; clients still get them. Recording
            # fails only the cache, which the next request retries.
            metrics.CATALOG_ERRORS.labels(operation="put_entry").inc()
            log.error("could not record repository=%s key=%s: %s", miss.repository, spec.key, exc)
            download.finish()
            if relayed is not None:
                self._end_relay(held, relayed)
                await relayed.stored(stored, None)
            if flight.transfer is None:
                flight.transfer = Transfer(await stored.open(), self.tasks.spawn)
            flight.settle(Streaming(flight.transfer))  # _conclude releases its last byte
            return
        self.index.put(entry)
        download.finish()
        if relayed is not None:
            self._end_relay(held, relayed)
            await relayed.stored(stored, entry)
        if flight.transfer is not None:
            await flight.transfer.stored(stored, entry)
        flight.settle(Stored(entry))

    def _end_relay(self, held: HeldLease | None, relayed: Transfer) -> None:
        """No new relay request is taken for this download; those reading it finish
        (or are cut, if it failed) as its transfer concludes."""
        if self.relay is not None and held is not None:
            self.relay.withdraw(held.fence)


async def _head_checked(body: AsyncIterator[bytes], spec: FetchSpec) -> AsyncIterator[bytes]:
    """``body`` again, once its first ``HEAD_BYTES`` (or all of it, if shorter) pass the
    head of ``spec.content``'s check; ``ContentMismatch`` if they do not."""
    head: list[bytes] = []
    size = 0
    async for chunk in body:
        head.append(chunk)
        size += len(chunk)
        if size >= CONTENT_HEAD_BYTES:
            break
    why = head_problem(b"".join(head)[:CONTENT_HEAD_BYTES], spec.content)
    if why is not None:
        raise ContentMismatch(
            f"{spec.key}: refused what the upstream sent: {why}; nothing was stored"
        )

    async def rest() -> AsyncIterator[bytes]:
        for chunk in head:
            yield chunk
        async for chunk in body:
            yield chunk

    return rest()


def _refused(spec: FetchSpec, why: str) -> ContentMismatch:
    return ContentMismatch(f"{spec.key}: refused what the upstream sent: {why}; nothing was stored")


def _too_large(miss: Miss, size: int) -> UpstreamUnavailable:
    return UpstreamUnavailable(
        f"{miss.key}: the upstream's body is {size} bytes, over repositories."
        f"{miss.repository}.max_file_size ({miss.max_size} bytes); nothing was stored"
    )


def _is_plain_name(name: str) -> bool:
    """A temp file's name as BlobStore makes them: nothing that could leave tmp/."""
    return bool(_TEMP_NAME_RE.fullmatch(name))


def _served(entry: Entry) -> Outcome:
    if entry.kind is Kind.NEGATIVE:
        return Missing(f"{entry.key} not found upstream")
    return Stored(entry)


async def _read_all(fetched: Fetched) -> bytes:
    assert fetched.body is not None
    chunks = []
    size = 0
    async for chunk in fetched.body:
        size += len(chunk)
        if size > INLINE_BODY_LIMIT_BYTES:
            raise UpstreamError(
                f"body over {INLINE_BODY_LIMIT_BYTES} bytes cannot be passed through uncached"
            )
        chunks.append(chunk)
    return b"".join(chunks)

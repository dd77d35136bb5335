"""The miss path (proxy/fetch/fetcher.py) as a unit, on proxy/testing's MemoryCatalog
and MockUpstream: single flight, negative entries, digest checks, stale copies and
lease takeover, with a ManualClock judging lease expiry. No socket, no database."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.cache.proxied import CatalogLinks
from proxy.catalog import Entry
from proxy.clock import ManualClock
from proxy.config.settings import LeaseSettings
from proxy.contract import (
    Digests,
    Fetched,
    FetchSpec,
    OriginContext,
    Status,
    Validators,
    WarmResult,
)
from proxy.exceptions import DigestMismatch, RetryLater, UpstreamUnavailable
from proxy.fetch.fetcher import Fetcher, Miss, Missing, Outcome, Stale, Stored, Streaming
from proxy.fetch.index import EntryIndex
from proxy.fetch.leases import LeaseCoordinator, lease_key
from proxy.runtime import metrics
from proxy.runtime.tasks import TaskSupervisor
from proxy.storage.blobs import BlobStore
from proxy.testing import MemoryCatalog, MockResponse, MockUpstream, UpstreamRequest
from proxy.types import Kind

pytestmark = pytest.mark.anyio

URL = "https://upstream.example/files/a.bin"
BODY = b"the body " * 1000
LEASE_TTL_S = 3.0


class PlainOrigin:
    """Asks ``url`` (conditionally with a stale copy's validators), as a raw origin does."""

    def __init__(self, url: str, expected: Digests | None = None) -> None:
        self.url = url
        self.expected = expected or {}

    @asynccontextmanager
    async def open(self, ctx: OriginContext, stale: Validators | None) -> AsyncIterator[Fetched]:
        headers = stale.conditional_headers() if stale is not None else {}
        async with ctx.upstream.open("GET", self.url, headers) as response:
            validators = Validators.of(response.headers)
            if response.status == 404:
                yield Fetched(Status.NOT_FOUND, message="not there")
            elif response.status == 304:
                yield Fetched(Status.NOT_MODIFIED, validators=validators)
            elif response.status != 200:
                raise UpstreamUnavailable(f"answered {response.status}")
            else:
                yield Fetched(
                    Status.OK,
                    body=response.body(),
                    content_type="application/octet-stream",
                    length=response.length,
                    validators=validators,
                    expected=self.expected,
                )


@dataclass
class Rig:
    fetcher: Fetcher
    catalog: MemoryCatalog
    upstream: MockUpstream
    blobs: BlobStore
    clock: ManualClock

    def miss(self, spec: FetchSpec) -> Miss:
        async def no_other_keys(other: FetchSpec) -> WarmResult:
            raise AssertionError("this origin needs no other key")

        async def compute(fn: object, *args: object) -> object:
            raise AssertionError("nothing to compute")

        context = OriginContext(
            self.upstream, CatalogLinks(self.catalog, "r"), no_other_keys, compute
        )
        return Miss("r", "raw", spec, context)

    async def fetch(self, spec: FetchSpec, stale: Entry | None = None) -> Outcome:
        return await self.fetcher.fetch(self.miss(spec), stale)

    async def body_of(self, outcome: Outcome) -> bytes:
        entry = await entry_of(outcome)
        assert entry.sha256 is not None
        return self.blobs.path(entry.sha256).read_bytes()


async def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``check()`` holds (a lease is released after the answer is given)."""
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - state in a catalog, not an event to await
            await asyncio.sleep(0.01)


def lease_state(r: Rig) -> tuple[str, str]:
    lease = r.catalog.leases[lease_key("r", "a.bin")]
    return lease.holder, lease.state


async def entry_of(outcome: Outcome) -> Entry:
    if isinstance(outcome, Streaming):
        entry = await outcome.transfer.result()
        assert entry is not None
        return entry
    assert isinstance(outcome, Stored | Stale), outcome
    return outcome.entry


def spec(kind: Kind = Kind.IMMUTABLE, expected: Digests | None = None, **kw: object) -> FetchSpec:
    return FetchSpec(key="a.bin", kind=kind, origin=PlainOrigin(URL, expected), **kw)  # type: ignore[arg-type]


@asynccontextmanager
async def rig(tmp_path: Path, handler: object, holder: str = "me") -> AsyncIterator[Rig]:
    clock = ManualClock()
    catalog = MemoryCatalog(clock)
    blobs = BlobStore(tmp_path / "data")
    blobs.prepare()
    tasks = TaskSupervisor()
    settings = LeaseSettings(ttl_s=LEASE_TTL_S, poll_interval_s=0.01)
    leases = LeaseCoordinator(catalog, settings, tasks, holder, clock)
    listener = tasks.spawn("lease-listener", catalog.listen_leases(leases.notify))
    upstream = MockUpstream(handler)  # type: ignore[arg-type]
    fetcher = Fetcher(catalog, blobs, EntryIndex(), leases, tasks, clock)
    try:
        yield Rig(fetcher, catalog, upstream, blobs, clock)
    finally:
        listener.cancel()
        await tasks.close(5)
        await leases.release_all()


def serve(body: bytes = BODY, **headers: str) -> object:
    async def handler(request: UpstreamRequest) -> MockResponse:
        await asyncio.sleep(0.05)  # long enough for every request to join the flight
        return MockResponse(200, [body[:4000], body[4000:]], dict(headers))

    return handler


async def test_one_flight_for_every_request_of_a_key(tmp_path: Path) -> None:
    async with rig(tmp_path, serve()) as r:
        outcomes = await asyncio.gather(*(r.fetch(spec()) for _ in range(20)))
        assert r.upstream.count(URL) == 1
        assert {(await entry_of(o)).sha256 for o in outcomes} == {hashlib.sha256(BODY).hexdigest()}
        assert await r.body_of(outcomes[0]) == BODY
        await eventually(lambda: lease_state(r) == ("me", "done"))


async def test_a_confirmed_miss_is_stored_as_a_negative_entry(tmp_path: Path) -> None:
    async with rig(tmp_path, lambda request: MockResponse(404)) as r:
        outcome = await r.fetch(spec(negative_ttl_s=60))
        assert isinstance(outcome, Missing) and outcome.message == "not there"
        negative = r.catalog.entries[("r", "a.bin")]
        assert negative.kind is Kind.NEGATIVE and negative.sha256 is None
        assert negative.expires_at_ms == r.clock.now_ms() + 60_000
    async with rig(tmp_path / "none", lambda request: MockResponse(404)) as r:
        assert isinstance(await r.fetch(spec(negative_ttl_s=0)), Missing)
        assert r.catalog.entries == {}


async def test_a_body_that_does_not_match_its_digest_is_never_stored(tmp_path: Path) -> None:
    async with rig(tmp_path, serve()) as r:
        before = metrics.DIGEST_MISMATCHES.labels(repository="r")._value.get()
        with pytest.raises(DigestMismatch, match="nothing was stored"):
            await entry_of(await r.fetch(spec(expected={"sha256": "0" * 64})))
        assert r.catalog.entries == {}
        await eventually(lambda: lease_state(r) == ("me", "failed"))
        assert list(r.blobs.tmp_dir.iterdir()) == []  # the temp file went too
        assert metrics.DIGEST_MISMATCHES.labels(repository="r")._value.get() == before + 1
        good = await r.fetch(spec(expected={"sha256": hashlib.sha256(BODY).hexdigest()}))
        assert await r.body_of(good) == BODY


async def test_an_expired_copy_answers_when_the_fetch_fails(tmp_path: Path) -> None:
    failures: list[Exception] = [UpstreamUnavailable("answered 500"), RetryLater("parsers busy")]

    def handler(request: UpstreamRequest) -> MockResponse:
        if failures:
            raise failures.pop(0)
        if request.headers.get("if-none-match") == '"v1"':
            return MockResponse(304, b"", {"etag": '"v1"'})
        return MockResponse(200, BODY, {"etag": '"v1"'})

    metadata = spec(Kind.METADATA, ttl_s=60)
    async with rig(tmp_path, lambda request: MockResponse(200, BODY, {"etag": '"v1"'})) as r:
        stored = await entry_of(await r.fetch(metadata))
    async with rig(tmp_path / "again", handler) as r:
        # Fetched 61 s ago with a TTL of 60 s: expired by today's TTL as by its own.
        fetched_at = r.clock.now_ms() - 61_000
        expired = dataclasses.replace(
            stored, fetched_at_ms=fetched_at, expires_at_ms=fetched_at + 60_000
        )
        await r.catalog.put_entry(expired)
        for reason in ("answered 500", "parsers busy"):  # the upstream's failure, and ours
            outcome = await r.fetch(metadata, stale=expired)
            assert isinstance(outcome, Stale) and reason in outcome.reason
        revalidated = await r.fetch(metadata, stale=expired)
        assert isinstance(revalidated, Stored)
        assert revalidated.entry.expires_at_ms == r.clock.now_ms() + 60_000
        assert r.upstream.requests[-1].headers["if-none-match"] == '"v1"'


async def test_an_expired_lease_is_taken_over_and_the_old_holder_fenced_off(tmp_path: Path) -> None:
    async with rig(tmp_path, serve()) as r:
        other = await r.catalog.claim_lease(lease_key("r", "a.bin"), "other", LEASE_TTL_S)
        assert other is not None
        takeovers = metrics.LEASE_TAKEOVERS.labels(repository="r")._value.get()
        waiting = asyncio.ensure_future(r.fetch(spec()))
        await asyncio.sleep(0.1)
        assert not waiting.done() and r.upstream.requests == []  # it waits for "other"
        r.clock.advance(LEASE_TTL_S)  # "other" stopped renewing
        outcome = await asyncio.wait_for(waiting, 10)
        assert await r.body_of(outcome) == BODY
        await eventually(lambda: lease_state(r) == ("me", "done"))
        assert r.catalog.leases[lease_key("r", "a.bin")].fence > other.fence
        assert not await r.catalog.release_lease(other, "done")  # its late release: nothing
        assert metrics.LEASE_TAKEOVERS.labels(repository="r")._value.get() == takeovers + 1


async def test_a_waiter_takes_the_entry_the_holder_stored(tmp_path: Path) -> None:
    async with rig(tmp_path, serve()) as r:
        grant = await r.catalog.claim_lease(lease_key("r", "a.bin"), "other", LEASE_TTL_S)
        assert grant is not None
        waiting = asyncio.ensure_future(r.fetch(spec()))
        await asyncio.sleep(0.05)
        # The other replica stores it, as its fetch would.
        async with rig(tmp_path / "other", serve()) as other_replica:
            stored = await entry_of(await other_replica.fetch(spec()))
        r.blobs.path(stored.sha256 or "").parent.mkdir(parents=True, exist_ok=True)
        r.blobs.path(stored.sha256 or "").write_bytes(BODY)
        await r.catalog.put_entry(stored)
        await r.catalog.release_lease(grant, "done")
        outcome = await asyncio.wait_for(waiting, 10)
        assert isinstance(outcome, Stored) and outcome.entry.sha256 == stored.sha256
        assert r.upstream.requests == []  # this replica never asked the upstream


async def test_a_failed_holder_sends_its_waiters_to_their_stale_copy(tmp_path: Path) -> None:
    async with rig(tmp_path, serve()) as r:
        stale = Entry("r", "a.bin", Kind.METADATA, "f" * 64, 3, None, 0, r.clock.now_ms() - 1)
        grant = await r.catalog.claim_lease(lease_key("r", "a.bin"), "other", LEASE_TTL_S)
        assert grant is not None
        waiting = asyncio.ensure_future(r.fetch(spec(Kind.METADATA, ttl_s=60), stale))
        await asyncio.sleep(0.05)
        await r.catalog.release_lease(grant, "failed")
        outcome = await asyncio.wait_for(waiting, 10)
        assert isinstance(outcome, Stale) and f"fence {grant.fence}" in outcome.reason
        assert r.upstream.requests == []


async def test_a_catalog_that_cannot_record_still_gives_clients_the_verified_bytes(
    tmp_path: Path,
) -> None:
    holder: list[MemoryCatalog] = []

    async def handler(request: UpstreamRequest) -> MockResponse:
        holder[0].outage = "the database went away"  # after the claim, before the record
        return MockResponse(200, BODY)

    async with rig(tmp_path, handler) as r:
        holder.append(r.catalog)
        outcome = await r.fetch(spec())
        assert isinstance(outcome, Streaming)
        assert await outcome.transfer.result() is None  # verified and kept, not recorded
        r.catalog.outage = None
        assert r.catalog.entries == {}
        assert r.blobs.path(hashlib.sha256(BODY).hexdigest()).read_bytes() == BODY

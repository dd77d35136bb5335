"""When a version was published, for one repository (docs/architecture.md, "Release
policy"): the time its index document states, the upstream's ``Last-Modified`` of the
key its format names (a Maven pom: asked for once through the cache, then kept in the
catalog), or the time this fleet first saw it listed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Protocol

from proxy.cache.documents import Listed
from proxy.catalog import Catalog, Entry
from proxy.clock import Clock
from proxy.contract import FetchSpec, Kind, ListedVersion
from proxy.policy.decisions import PublishTime

log = logging.getLogger("proxy.policy")

LAST_MODIFIED = "Last-Modified"


class ReleaseSource(Protocol):
    """What publish times are read from: a repository's cache (``cache.proxied``)."""

    async def listed(self, spec: FetchSpec, refresh: bool = False) -> Listed | None:
        """What a stored index document lists (fetched if absent, or if ``refresh``:
        again if expired); None if the upstream has no such document."""
        ...

    async def stored(self, spec: FetchSpec) -> Entry | None:
        """The entry of ``spec.key``, fetched if absent; None if the upstream has none."""
        ...


@dataclass(frozen=True)
class Times:
    """What is known of when a version was published. ``durable``: it will not change
    (False when an upstream could not be asked: a later decision asks again)."""

    published: PublishTime | None = None
    first_seen_ms: int | None = None
    durable: bool = True
    # The version is not on its index document: its format fetches only what is listed
    # (a 404), and a stored copy of a version no longer listed is judged by rules alone.
    unlisted: bool = False


class PublishTimes:
    def __init__(self, repository: str, catalog: Catalog, clock: Clock) -> None:
        self.repository = repository
        self.catalog = catalog
        self.clock = clock

    @staticmethod
    def listed(listed: Listed, version: ListedVersion) -> Times:
        """A listed version's time: the one its document states, else its first sight."""
        if version.published_at_ms is not None:
            return Times(PublishTime(version.published_at_ms, listed.time_source))
        return Times(first_seen_ms=listed.first_seen_of(version))

    async def first_seen(self, key: str) -> int:
        """When this fleet first saw ``key`` (now, if never before)."""
        seen = await self.catalog.record_first_sight(
            self.repository, json.dumps([key]), self.clock.now_ms()
        )
        at_ms: int = json.loads(seen)[key]
        return at_ms

    async def last_modified(self, source: ReleaseSource, spec: FetchSpec) -> Times:
        """The upstream's Last-Modified of ``spec.key``: kept in the catalog once learnt
        (it outlives the entry), else read from the entry, fetched through the cache
        (single flight, leases) if need be. A mutable key's (a SNAPSHOT pom) is never
        kept: the next deploy changes it, so it is judged again a minute later."""
        immutable = spec.kind is Kind.IMMUTABLE
        if immutable:
            known = await self.catalog.known_times(self.repository, [spec.key])
            times = known.get(spec.key)
            if times is not None and times.upstream_ms is not None:
                return Times(PublishTime(times.upstream_ms, LAST_MODIFIED), times.first_seen_ms)
        entry = await source.stored(spec)
        at_ms = _http_date_ms(entry.last_modified) if entry is not None else None
        if at_ms is None:
            return Times(first_seen_ms=await self.first_seen(spec.key), durable=immutable)
        if immutable:
            now_ms = self.clock.now_ms()
            await self.catalog.record_upstream_time(self.repository, spec.key, at_ms, now_ms)
        return Times(PublishTime(at_ms, LAST_MODIFIED), durable=immutable)


def _http_date_ms(value: str | None) -> int | None:
    if not value:
        return None
    try:
        return int(parsedate_to_datetime(value).timestamp() * 1000)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None

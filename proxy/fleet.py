"""This replica's place in the fleet: a heartbeat row in the catalog
(docs/architecture.md, "Operating: console, API and logs").

Every ``HEARTBEAT_INTERVAL_S`` one statement upserts the replica's row in ``replicas``:
its address and version, and its counters since it started (hits and misses per
repository, upstream health per host). The console's fleet-wide numbers are sums over
these rows, so no hit ever writes. The same statement returns the newest purge id: a
package or entry purged on another replica makes this one forget what it remembers of
that repository, so its next request looks in the catalog again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from proxy import __version__
from proxy.catalog import Catalog, Replica
from proxy.exceptions import CatalogError

if TYPE_CHECKING:
    from proxy.fetch.index import EntryIndex

log = logging.getLogger("proxy.fleet")

# One cheap statement per replica every 15 s (0.07 statements/s): within the idle
# budget of a replica (docs/architecture.md, "Operating: console, API and logs").
HEARTBEAT_INTERVAL_S = 15.0
# A replica whose row is older than this is shown as gone.
REPLICA_GONE_AFTER_S = 3 * HEARTBEAT_INTERVAL_S


class Counted(Protocol):
    """A repository's view, counting its hits and misses since the process started."""

    hits: int
    misses: int


class Heartbeat:
    def __init__(
        self,
        catalog: Catalog,
        holder: str,
        url: str,
        started_at_ms: int,
        views: Mapping[str, Counted],
        upstream_health: Callable[[], dict[str, Any]],
        index: EntryIndex,
    ) -> None:
        self.catalog = catalog
        self.holder = holder
        self.url = url
        self.started_at_ms = started_at_ms
        self.views = views
        self.upstream_health = upstream_health
        self.index = index
        self.seen_purge: int | None = None  # None: not looked yet

    def replica(self) -> Replica:
        stats = {
            "hits": {name: view.hits for name, view in self.views.items()},
            "misses": {name: view.misses for name, view in self.views.items()},
            "upstreams": self.upstream_health(),
        }
        return Replica(
            holder=self.holder,
            host=socket.gethostname(),
            pid=os.getpid(),
            url=self.url,
            version=__version__,
            started_at_ms=self.started_at_ms,
            seen_at_ms=0,  # the database's clock sets it
            stats=stats,
            now_ms=0,
        )

    async def beat(self) -> None:
        newest = await self.catalog.heartbeat(self.replica())
        if self.seen_purge is None:
            self.seen_purge = newest  # nothing was remembered before we started
            return
        while newest > self.seen_purge:
            purges = await self.catalog.purges_after(self.seen_purge)
            if not purges:
                break
            for repository in {purge.repository for purge in purges}:
                dropped = self.index.drop_repository(repository)
                log.info("purged elsewhere: forgot %d entries of %s", dropped, repository)
            self.seen_purge = purges[-1].id

    async def run_forever(self) -> None:
        while True:
            try:
                await self.beat()
            except CatalogError as exc:
                log.warning("heartbeat: database unavailable: %s", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

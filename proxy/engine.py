"""The engine assembled: every resource the proxy runs on, built from ``Settings``.

``open_engine`` is the composition root: it opens the catalog and the blob store,
builds the fetch machinery and one adapter per repository (looking formats up in the
registry), and on exit hands every lease back and closes what it opened. The HTTP app
(``http/app.py``) serves it; a command that needs the engine without a server opens it the
same way (docs/architecture.md, "Module map").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from proxy import formats
from proxy.cache import Cache
from proxy.cache.documents import Documents
from proxy.cache.hosted import CountedUploads, HostedView
from proxy.cache.proxied import ProxiedView
from proxy.cache.quarantine import Quarantine
from proxy.catalog import Catalog, open_catalog
from proxy.clock import Clock
from proxy.config.settings import PolicySettings, RepositorySettings, Settings
from proxy.contract import (
    Adapter,
    FormatPlugin,
    HostedContext,
    PackageVersion,
    ProxyContext,
    UpstreamClient,
)
from proxy.exceptions import CatalogError, InvalidPlugin, ProxyError
from proxy.fetch.fetcher import Fetcher
from proxy.fetch.fill import TierFills
from proxy.fetch.index import AccessLog, EntryIndex
from proxy.fetch.leases import LeaseCoordinator, make_holder_id
from proxy.fetch.relay import RelayServer
from proxy.fetch.relayed import RelayClient
from proxy.fleet import Counted, Heartbeat
from proxy.http.bodies import BlobFiles, HotBlobs, MarkCounts
from proxy.http.lane import HitLane
from proxy.http.responses import FormatResponses
from proxy.jobs import Job, Scheduler, standard_jobs
from proxy.jobs.packages import PackageBackfill
from proxy.mirror.runner import Mirrors, MirrorSource
from proxy.policy import explain
from proxy.policy.gate import Policies, ReleaseGate
from proxy.policy.times import PublishTimes
from proxy.runtime import metrics
from proxy.runtime.blocking import CpuPool, install_io_executor
from proxy.runtime.tasks import TaskSupervisor, watch_loop_lag
from proxy.runtime.throttle import FailureThrottle
from proxy.storage.blobs import BlobStore
from proxy.storage.objects import ObjectStorage
from proxy.storage.store import Storage, open_storage
from proxy.upstream.client import UpstreamPool

log = logging.getLogger("proxy.engine")

ACCESS_FLUSH_INTERVAL_S = 5.0
SHUTDOWN_TASK_TIMEOUT_S = 10.0
PACKAGES_INTERVAL_S = 3600.0  # the package backfill: real work once, then one read a pass


@dataclass
class Engine:
    settings: Settings
    clock: Clock
    catalog: Catalog
    storage: Storage
    blobs: BlobStore  # this process's folder (storage.files)
    cache: Cache
    adapters: dict[str, Adapter]
    tasks: TaskSupervisor
    leases: LeaseCoordinator
    holder: str
    size_limits: dict[str, int]  # repositories whose format keeps them under a size
    # Proxying repositories without an upstream -> the 503 message naming the setting.
    not_configured: dict[str, str]
    mirrors: Mirrors
    upstreams: UpstreamPool  # the httpx client, host slots and circuits of every repository
    # Each repository's hit and miss counters (for the heartbeat), and the formats'
    # package_of of the repositories grouped by package (browsing, purges).
    views: dict[str, Counted] = field(default_factory=dict)
    package_of: dict[str, Callable[[str], PackageVersion | None]] = field(default_factory=dict)
    # The stored spelling of a package name a person typed (contract.Packages.name).
    package_names: dict[str, Callable[[str], str]] = field(default_factory=dict)
    # Repositories whose format's clients read errors as JSON (FormatPlugin.error_bodies).
    json_errors: frozenset[str] = frozenset()
    started_at_ms: int = 0
    # The release policy now (replaced on reload), and the gates of the repositories
    # whose releases it judges.
    policies: Policies = field(default_factory=lambda: Policies(PolicySettings(), {}))
    gates: dict[str, ReleaseGate] = field(default_factory=dict)
    # Fresh hits' answers, sent by the HTTP protocol without the app (http/lane.py).
    lane: HitLane | None = None
    _stopping: asyncio.Future[None] | None = field(default=None, repr=False)

    def start_background(self, scheduler: bool = True) -> None:
        """Access-time flushes, lease notifications and (if asked) the job scheduler
        and the storage gauges."""
        self.tasks.spawn("access-flush", _flush_access_forever(self.cache))
        self.tasks.spawn("loop-lag", watch_loop_lag())
        if self.settings.leases.notify:
            self.tasks.spawn(
                "lease-listener",
                self.catalog.listen_leases(self.leases.notify, self.leases.set_listening),
            )
        if scheduler:
            jobs = Scheduler(self.catalog, self.holder, self.tasks, self.clock)
            for job in self.jobs():
                jobs.add(job)
            jobs.start()
            period_s = self.settings.jobs.evict_interval_s
            self.tasks.spawn("storage-gauges", _measure_storage_forever(self.cache, period_s))
            self.tasks.spawn("heartbeat", self.heartbeat().run_forever())

    def upstream_health(self) -> dict[str, Any]:
        """Per upstream host: answers, failures, the last error, and its circuit."""
        health = self.upstreams.health.snapshot()
        for host, circuit in self.upstreams.circuits.items():
            health.setdefault(host, {})["circuit"] = circuit.state.name.lower().replace("_", "-")
        return health

    def heartbeat(self) -> Heartbeat:
        """This replica's row in ``replicas`` (proxy/fleet.py)."""
        return Heartbeat(
            self.catalog,
            self.holder,
            self.settings.base_url,
            self.started_at_ms,
            self.views,
            self.upstream_health,
            self.cache.index,
        )

    def jobs(self) -> list[Job]:
        """Every job and schedule this configuration runs (docs/architecture.md, "Jobs")."""
        jobs = standard_jobs(
            self.settings, self.catalog, self.storage, self.cache, self.clock, self.size_limits
        )
        if self.package_of:
            backfill = PackageBackfill(self.catalog, self.package_of)
            jobs.append(Job("packages", PACKAGES_INTERVAL_S, backfill.run))
        for mirror in self.settings.mirrors:
            jobs.append(Job(mirror.job_name, mirror.interval_s, self.mirrors.job(mirror)))
        return jobs

    def gate_for(self, purl_type: str, repository: str | None = None) -> ReleaseGate | None:
        """The gate of ``repository``, or of the first repository whose releases of
        ``purl_type`` the policy judges."""
        if repository is not None:
            gate = self.gates.get(repository)
            return gate if gate is not None and gate.releases.purl_type == purl_type else None
        return next((g for g in self.gates.values() if g.releases.purl_type == purl_type), None)

    async def release_decision(self, repository: str, key: str) -> dict[str, Any] | None:
        """What the release policy decides for a stored entry's key (the operators'
        console shows it): ``decision`` in words, its reason, package, version, action
        and rule; None if no policy could withhold anything there, or the key belongs to
        no release. A publish time it needs is asked for through the cache, as a request
        would; one it cannot learn now is said so, never an error of the page."""
        gate = self.gates.get(repository)
        if gate is None or not self.policies.current.active(repository):
            return None
        try:
            found = await gate.of_key(key)
        except ProxyError as exc:
            return {"decision": "unknown", "reason": f"cannot be decided now: {exc}"}
        if found is None:
            return None
        version, decision = found
        facts = explain.facts(decision, gate.purl(version.package), version.version)
        facts["decision"] = explain.verdict(decision)
        facts["enforced"] = not self.policies.current.report_only
        return facts

    def reload_policy(self, settings: Settings) -> None:
        """Apply a new ``[policy]`` (and the repositories' ``cooldown``) from ``settings``;
        every decision made under the old one is made again when next needed
        (docs/architecture.md, "Release policy"). Nothing else of ``settings`` is used."""
        self.policies.replace(settings.policy, cooldowns(settings))
        if self.lane is not None:
            self.lane.clear()  # its answers were judged under the old policy

    def stop(self) -> asyncio.Future[None]:
        """Cancel every fetch and job, then hand back every lease (idempotent)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        return self._stopping

    async def _stop(self) -> None:
        # Cancel fetches first: each releases its lease as it unwinds, so another
        # replica takes over at once; then release anything left and wait for it.
        await self.tasks.close(SHUTDOWN_TASK_TIMEOUT_S)
        await self.leases.release_all()


@dataclass(frozen=True)
class Seams:
    """What a test puts in place of the outside world (``proxy/testing.py``): a catalog
    instead of the one ``database.url`` names, one upstream client for every repository
    instead of the HTTP pool. Production passes none."""

    catalog: Catalog | None = None
    upstream: UpstreamClient | None = None


@asynccontextmanager
async def open_engine(
    settings: Settings, clock: Clock, seams: Seams | None = None
) -> AsyncIterator[Engine]:
    seams = seams or Seams()
    install_io_executor(asyncio.get_running_loop())
    async with contextlib.AsyncExitStack() as stack:
        storage = open_storage(settings)
        await storage.start()
        stack.push_async_callback(storage.close)
        relay = relays = None
        if isinstance(storage, ObjectStorage):
            # No shared volume: in-flight downloads cross replicas through relays
            # (docs/architecture.md, "Streaming across replicas on object storage").
            host = settings.relay_host if settings.relay_host is not None else settings.host
            relay = RelayServer(host, settings.relay_port, settings.relay_url)
            await relay.start()
            stack.push_async_callback(relay.close)
            relays = RelayClient(storage.files, settings.upstream, storage.tier.adopt)
            stack.push_async_callback(relays.aclose)
        async with _engine(settings, clock, seams, storage, relay, relays) as engine:
            yield engine


@asynccontextmanager
async def _engine(
    settings: Settings,
    clock: Clock,
    seams: Seams,
    storage: Storage,
    relay: RelayServer | None,
    relays: RelayClient | None,
) -> AsyncIterator[Engine]:
    catalog = seams.catalog or open_catalog(
        settings.database_url, clock, connections=settings.database
    )
    try:
        applied = await catalog.migrate()
        if applied:
            log.info("applied migrations: %s", ", ".join(applied))
        pool = UpstreamPool(settings.upstream)
        cpu = CpuPool(deadline_s=settings.upstream.parse_timeout_s)
        try:
            tasks = TaskSupervisor()
            holder = make_holder_id()
            leases = LeaseCoordinator(catalog, settings.leases, tasks, holder, clock)
            index, access, hot, marks = EntryIndex(), AccessLog(clock), HotBlobs(), MarkCounts()
            # Blobs verified when read (docs/architecture.md): one quarantine and one set
            # of stamps per process.
            files = BlobFiles(storage.files.stamps, settings.storage.verify_reads)
            quarantine = Quarantine(catalog, storage, index, hot, marks, tasks)
            fills = (
                TierFills(storage, tasks, files, quarantine)
                if isinstance(storage, ObjectStorage)
                else None
            )
            fetcher = Fetcher(
                catalog, storage, index, leases, tasks, clock,
                open_stored=fills.source if fills is not None else None,
                relay=relay, relays=relays, min_free=settings.storage.min_free,
            )  # fmt: skip
            s3 = settings.object_storage
            cache = Cache(
                catalog, storage, fetcher, index, access, hot, clock, marks, files, quarantine,
                bodies=fills.body if fills is not None else None,
                redirect_min_size=s3.redirect_min_size if s3 is not None else None,
            )  # fmt: skip
            documents = Documents(catalog, storage.files.root, cpu.run, clock)
            await documents.start()
            policies = Policies(settings.policy, cooldowns(settings))
            built = Repositories(documents, policies)
            for repo in settings.repositories:
                upstream = seams.upstream or pool.for_repository(
                    repo.name, repo.upstreams, repo.allow_hosts
                )
                built.add(repo, formats.plugin(repo.format), cache, upstream, cpu, settings.host)
            if settings.storage.max_size is not None:
                metrics.STORAGE_MAX_BYTES.set(settings.storage.max_size)
            mirrors = Mirrors(
                built.mirror_sources,
                built.not_configured,
                catalog,
                holder,
                tasks.spawn,
                lambda: tasks.closing,
            )
            engine = Engine(
                settings,
                clock,
                catalog,
                storage,
                storage.files,
                cache,
                built.adapters,
                tasks,
                leases,
                holder,
                built.size_limits,
                built.not_configured,
                mirrors,
                pool,
                views=built.views,
                package_of=built.package_of,
                package_names=built.package_names,
                json_errors=frozenset(built.json_errors),
                started_at_ms=clock.now_ms(),
                policies=policies,
                gates=built.gates,
                lane=HitLane(index, clock),
            )
            try:
                yield engine
            finally:
                await engine.stop()
                flushed = await cache.flush_access()
                log.info("shut down: flushed %d access times", flushed)
        finally:
            cpu.close()
            await pool.aclose()
    finally:
        await catalog.close()
        # With several workers, drop this process's live gauges from the aggregate.
        metrics.mark_process_dead(os.getpid())


def cooldowns(settings: Settings) -> dict[str, float | None]:
    """Each repository's own ``cooldown`` (None: ``[policy].cooldown``)."""
    return {repo.name: repo.cooldown_s for repo in settings.repositories}


@dataclass
class Repositories:
    """Each repository built on what its format declares (``contract.Proxying``,
    ``Hosting``, ``Mirroring``, ``Releases``): its adapter, and what the engine keeps
    about it."""

    documents: Documents
    policies: Policies
    adapters: dict[str, Adapter] = field(default_factory=dict)
    gates: dict[str, ReleaseGate] = field(default_factory=dict)
    size_limits: dict[str, int] = field(default_factory=dict)  # hosted, kept under a size
    # Proxying repositories without an upstream -> the 503 message naming the setting.
    not_configured: dict[str, str] = field(default_factory=dict)
    mirror_sources: dict[str, MirrorSource] = field(default_factory=dict)  # in config order
    views: dict[str, Counted] = field(default_factory=dict)
    package_of: dict[str, Callable[[str], PackageVersion | None]] = field(default_factory=dict)
    package_names: dict[str, Callable[[str], str]] = field(default_factory=dict)
    json_errors: set[str] = field(default_factory=set)

    def add(
        self,
        repo: RepositorySettings[Any],
        plugin: FormatPlugin[Any, Any],
        cache: Cache,
        upstream: UpstreamClient,
        cpu: CpuPool,
        listen_host: str,
    ) -> None:
        responses = FormatResponses(repo.name)
        package_of = plugin.packages.of if plugin.packages is not None else None
        if plugin.packages is not None:
            self.package_of[repo.name] = plugin.packages.of
            self.package_names[repo.name] = plugin.packages.name
        if plugin.error_bodies == "json":
            self.json_errors.add(repo.name)
        if plugin.proxying is not None:
            view = ProxiedView(
                cache, repo.name, repo.format, upstream, cpu, self.documents,
                repo.max_file_size, package_of,
            )  # fmt: skip
            self.views[repo.name] = view
            context = ProxyContext(cache=view, compute=cpu.run, responses=responses)
            adapter = _checked(plugin, "proxying", plugin.proxying.build(repo, context))
            self.adapters[repo.name] = adapter
            if plugin.releases is not None and plugin.packages is not None:
                gate = ReleaseGate(
                    repo.name,
                    self.policies,
                    plugin.releases,
                    plugin.packages.of,
                    PublishTimes(repo.name, cache.catalog, cache.clock),
                    cache.clock,
                )
                gate.bind(adapter, view)
                view.gate = gate
                self.gates[repo.name] = gate
            if plugin.mirroring is not None:
                self.mirror_sources[repo.name] = MirrorSource(
                    plugin.mirroring.purl_types,
                    functools.partial(plugin.mirroring.keys, adapter),
                    view,
                )
            if not repo.upstreams:
                self.not_configured[repo.name] = (
                    f"repository {repo.name!r} has no upstream configured; "
                    f"set {repo.upstream_setting}"
                )
                log.warning(
                    "repository %r has no upstream: its requests get 503 until you set %s",
                    repo.name,
                    repo.upstream_setting,
                )
        elif plugin.hosting is not None:
            hosted = HostedView(cache, repo.name, repo.format)
            self.views[repo.name] = hosted
            hosting = HostedContext(store=hosted, responses=responses, throttle=FailureThrottle())
            built = _checked(plugin, "hosting", plugin.hosting.build(repo, hosting))
            self.adapters[repo.name] = CountedUploads(built, repo.name)
            if plugin.hosting.max_size is not None:
                limit = plugin.hosting.max_size(repo.options)
                if limit is not None:
                    self.size_limits[repo.name] = limit
        else:  # formats.verify refuses such a plugin before we get here
            raise InvalidPlugin(f"format {plugin.name!r} declares no way to serve {repo.name!r}")
        for warning in plugin.warnings(repo, listen_host) if plugin.warnings else ():
            log.warning("%s", warning)


def _checked(plugin: FormatPlugin[Any, Any], capability: str, adapter: Adapter) -> Adapter:
    """``adapter`` if it can answer requests; ``InvalidPlugin`` naming the format if not (a
    builder function's adapter cannot be checked before it is built)."""
    problems = list(formats.adapter_problems(adapter))
    if problems:
        raise InvalidPlugin(
            f"format {plugin.name!r}: {capability}.build built an adapter that cannot "
            f"answer requests: {'; '.join(problems)}"
        )
    return adapter


async def _flush_access_forever(cache: Cache) -> None:
    while True:
        await asyncio.sleep(ACCESS_FLUSH_INTERVAL_S)
        await cache.flush_access()


async def _measure_storage_forever(cache: Cache, period_s: float) -> None:
    """Every replica refreshes its own storage gauges (one aggregate query per period),
    so no replica exports the total of a pass that ran elsewhere long ago."""
    while True:
        try:
            await cache.storage_usage()
        except CatalogError as exc:
            log.warning("could not measure storage: %s", exc)
        await asyncio.sleep(period_s * random.uniform(0.8, 1.0))

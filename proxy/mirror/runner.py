"""Mirrors: warm the cache with the packages that purls (and SBOMs) name
(docs/architecture.md, "Mirrors").

A run resolves each purl to a repository (the named one, or the first whose format
mirrors the purl's type), asks that repository's format which keys make up the
package (its ``contract.Mirroring.keys``), and warms each key through the cache: items
already cached and fresh cost no upstream request, and an item a client is fetching
shares that fetch (single flight and fetch leases). Every failure is logged and
counted and the run goes on. The scheduler runs each ``[[mirrors]]`` once per interval
for the fleet (job ``mirror:<name>``); ``proxy mirror`` runs one pass now.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast

from proxy.config.settings import MirrorSettings
from proxy.contract import FetchSpec, MirrorVersions, ProxyCache
from proxy.exceptions import NotConfigured, NotFound, ProxyError, ShuttingDown
from proxy.mirror.purls import parse_purl
from proxy.mirror.runs import describe_request, run_recorded
from proxy.mirror.sbom import purls_in_sbom
from proxy.runtime import metrics
from proxy.runtime.blocking import run_blocking
from proxy.types import PackageRef
from proxy.units import human_size

if TYPE_CHECKING:
    from proxy.catalog import Catalog

log = logging.getLogger("proxy.mirrors")
T = TypeVar("T")

MIRROR_CONCURRENCY = 4  # packages resolved and keys warmed at once, per run
SBOM_LIMIT_BYTES = 64 * 1024 * 1024

Outcome = Literal["fetched", "cached", "missing", "failed", "skipped"]


@dataclass
class MirrorSummary:
    fetched: int = 0
    cached: int = 0  # already cached and fresh: no upstream request
    missing: int = 0  # confirmed absent upstream (e.g. no jar for a pom-only artifact)
    failed: int = 0
    skipped: int = 0  # purls of a type no repository here mirrors
    bytes: int = 0  # of the items fetched

    def add(self, outcome: Outcome, size: int = 0) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if outcome == "fetched":
            self.bytes += size

    def as_dict(self) -> dict[str, int]:
        return {
            "fetched": self.fetched,
            "cached": self.cached,
            "missing": self.missing,
            "failed": self.failed,
            "skipped": self.skipped,
            "bytes": self.bytes,
        }

    def line(self) -> str:
        return (
            f"{self.fetched} fetched ({human_size(self.bytes)}), {self.cached} already cached, "
            f"{self.missing} missing upstream, {self.failed} failed, {self.skipped} skipped"
        )


class Progress(Protocol):
    """What a run reports as it goes (``proxy mirror`` draws it)."""

    def planned(self, items: int) -> None:
        """``items`` more keys are known to warm."""
        ...

    def done(self, label: str, outcome: Outcome, size: int) -> None: ...


class _Quiet:
    def planned(self, items: int) -> None:
        pass

    def done(self, label: str, outcome: Outcome, size: int) -> None:
        pass


@dataclass(frozen=True)
class MirrorSource:
    """A repository whose format declares mirroring: the purl types it takes, how to
    list a package's keys (its format's ``Mirroring.keys``, bound to its adapter), and
    the cache those keys are warmed in."""

    purl_types: tuple[str, ...]
    keys: Callable[[PackageRef, MirrorVersions], Awaitable[list[FetchSpec]]]
    cache: ProxyCache


@dataclass(frozen=True)
class Target:
    package: PackageRef
    repository: str


class Mirrors:
    """Runs mirror passes over the engine's repositories."""

    def __init__(
        self,
        sources: Mapping[str, MirrorSource],
        not_configured: Mapping[str, str],
        catalog: Catalog | None = None,
        holder: str = "",
        spawn: Callable[[str, Coroutine[Any, Any, Any]], object] | None = None,
        closing: Callable[[], bool] | None = None,
    ) -> None:
        # Repository name -> what it mirrors; in config order, so the first repository
        # serving a type is the default.
        self.sources = sources
        # Repository name -> why it has no upstream (the engine's own check, which
        # requests pass through and mirrors, calling adapters directly, would not).
        self.not_configured = not_configured
        # Where runs are recorded (mirror/runs.py), who we are, and the task group that
        # runs the admin API's runs in the background.
        self.catalog = catalog
        self.holder = holder
        self.spawn = spawn
        self.closing = closing

    async def record(
        self,
        name: str,
        origin: str,
        purls: Sequence[str],
        sbom: Path | None,
        versions: str,
        repository: str | None,
        progress: Progress | None = None,
    ) -> tuple[int, str, MirrorSummary | None]:
        """One pass, recorded as a mirror run: (its id, the state it ended in, the
        summary if it ran to the end)."""
        run_id = await self.create_run(name, origin, list(purls), sbom, versions, repository)
        state, summary = await self.execute(
            run_id, name, purls, sbom, versions, repository, progress
        )
        return run_id, state, summary

    async def create_run(
        self,
        name: str,
        origin: str,
        purls: list[str],
        sbom: Path | None,
        versions: str,
        repository: str | None,
    ) -> int:
        assert self.catalog is not None
        request = describe_request(purls, str(sbom) if sbom else None, versions, repository)
        return await self.catalog.create_mirror_run(name, origin, self.holder, request)

    async def execute(
        self,
        run_id: int,
        name: str,
        purls: Sequence[str],
        sbom: Path | None,
        versions: str,
        repository: str | None,
        progress: Progress | None = None,
    ) -> tuple[str, MirrorSummary | None]:
        assert self.catalog is not None

        def work(recorded: Progress) -> Awaitable[MirrorSummary]:
            return self.run(name, purls, sbom, versions, repository, recorded)

        return await run_recorded(self.catalog, run_id, work, progress)

    async def launch(
        self, name: str, purls: list[str], versions: str, repository: str | None
    ) -> int:
        """Start a run in the background (the admin API's); its id at once."""
        assert self.spawn is not None
        if self.closing is not None and self.closing():
            raise ShuttingDown("the proxy is shutting down; start the run on another replica")
        run_id = await self.create_run(name, "api", purls, None, versions, repository)
        self.spawn(
            f"mirror-run:{run_id}",
            self.execute(run_id, name, purls, None, versions, repository),
        )
        return run_id

    def supported_types(self, repository: str | None = None) -> list[str]:
        """The purl types some repository here (or ``repository``) mirrors."""
        found: list[str] = []
        for repo, source in self.sources.items():
            if repository in (None, repo):
                found += [t for t in source.purl_types if t not in found]
        return found

    def unsupported(self, purls: Iterable[str], repository: str | None = None) -> list[str]:
        """A message for each purl whose type no repository here mirrors, naming the
        types that are (a purl given by hand is an error, not an item to skip)."""
        supported = self.supported_types(repository)
        messages = []
        for text in purls:
            purl_type = parse_purl(text).type
            if purl_type not in supported:
                where = f"repository {repository!r}" if repository else "no repository here"
                messages.append(
                    f"{text}: {where} mirrors purl type {purl_type!r}; supported: "
                    + (", ".join(supported) or "none (no repository mirrors packages)")
                )
        return messages

    def job(self, mirror: MirrorSettings) -> Callable[[], Awaitable[str]]:
        async def run() -> str:
            args = (mirror.packages, mirror.sbom, mirror.versions, mirror.repository)
            if self.catalog is None:
                return (await self.run(mirror.name, *args)).line()
            run_id, state, summary = await self.record(mirror.name, "schedule", *args)
            return (summary.line() if summary else "stopped") + f" (mirror run {run_id}: {state})"

        return run

    async def run(
        self,
        name: str,
        purls: Sequence[str],
        sbom: Path | None,
        versions: str,
        repository: str | None,
        progress: Progress | None = None,
    ) -> MirrorSummary:
        """One pass: every purl given and every purl in ``sbom``."""
        progress = progress or _Quiet()
        summary = MirrorSummary()

        def count(label: str, outcome: Outcome, size: int = 0) -> None:
            summary.add(outcome, size)
            metrics.MIRROR_ITEMS.labels(mirror=name, outcome=outcome).inc()
            progress.done(label, outcome, size)

        listed = list(purls)
        if sbom is not None:
            try:
                listed += await run_blocking(read_sbom, sbom)
            except ValueError as exc:
                log.error("mirror %s: sbom %s: %s", name, sbom, exc)
                progress.planned(1)
                count(str(sbom), "failed")
        targets = self.targets(name, listed, repository, count, progress)
        mode = cast(MirrorVersions, versions)
        specs: list[tuple[str, FetchSpec]] = []

        async def plan(target: Target) -> None:
            source = self.sources[target.repository]
            try:
                if target.repository in self.not_configured:
                    raise NotConfigured(self.not_configured[target.repository])
                found = await source.keys(target.package, mode)
            except NotFound as exc:
                log.warning("mirror %s: %s: %s", name, target.package, exc)
                count(str(target.package), "missing")
                return
            except (ProxyError, OSError) as exc:
                log.error("mirror %s: %s: %s", name, target.package, exc)
                count(str(target.package), "failed")
                return
            if not found:
                count(str(target.package), "missing")
                return
            progress.planned(len(found) - 1)  # the package itself was counted as one
            specs.extend((target.repository, spec) for spec in found)

        progress.planned(len(targets))
        await _each(targets, plan)

        async def warm(item: tuple[str, FetchSpec]) -> None:
            repository, spec = item
            label = f"{repository}/{spec.key}"
            try:
                result = await self.sources[repository].cache.warm(spec)
            except (ProxyError, OSError) as exc:
                log.error("mirror %s: %s: %s", name, label, exc)
                count(label, "failed")
                return
            count(label, result.outcome, result.size)

        await _each(specs, warm)
        return summary

    def targets(
        self,
        name: str,
        purls: Iterable[str],
        repository: str | None,
        count: Callable[[str, Outcome], None],
        progress: Progress,
    ) -> list[Target]:
        """Each purl and the repository that mirrors it (skipped, counted, if none does)."""
        found: dict[tuple[str, str], Target] = {}
        for text in purls:
            try:
                package = parse_purl(text)
            except ValueError as exc:
                log.error("mirror %s: %s", name, exc)
                progress.planned(1)
                count(text, "failed")
                continue
            serving = [
                repo
                for repo, source in self.sources.items()
                if package.type in source.purl_types and repository in (None, repo)
            ]
            if not serving:
                log.warning(
                    "mirror %s: %s: no repository here mirrors purl type %r (supported: %s); "
                    "skipped",
                    name,
                    package,
                    package.type,
                    ", ".join(self.supported_types(repository)) or "none",
                )
                progress.planned(1)
                count(str(package), "skipped")
                continue
            found.setdefault((serving[0], package.purl), Target(package, serving[0]))
        return list(found.values())


def read_sbom(path: Path) -> list[str]:
    """The purls of an SBOM file (blocking: run it in the I/O pool)."""
    try:
        with path.open("rb") as fh:
            data = fh.read(SBOM_LIMIT_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror})") from None
    if len(data) > SBOM_LIMIT_BYTES:
        raise ValueError(f"is over {SBOM_LIMIT_BYTES} bytes")
    return purls_in_sbom(data)


async def _each(items: Sequence[T], work: Callable[[T], Awaitable[None]]) -> None:
    """``work`` on every item, ``MIRROR_CONCURRENCY`` at a time; cancellation stops all."""
    queue = iter(items)

    async def worker() -> None:
        for item in queue:
            await work(item)

    async with asyncio.TaskGroup() as group:
        for _ in range(min(MIRROR_CONCURRENCY, len(items))):
            group.create_task(worker())

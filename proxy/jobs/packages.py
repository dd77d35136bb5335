"""Packages for entries stored before they were recorded (docs/architecture.md,
"Operating: console, API and logs"): once per repository whose format groups keys by
package, every entry without one is given its package and version, so browsing by
package and purging a package find them. Entries stored since carry theirs, so a
repository done stays done (``package_backfills``); then a pass is one read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from proxy.catalog import Catalog
from proxy.contract import PackageVersion
from proxy.runtime.blocking import run_blocking

BATCH_ENTRIES = 1000


class PackageBackfill:
    def __init__(
        self, catalog: Catalog, package_of: Mapping[str, Callable[[str], PackageVersion | None]]
    ) -> None:
        self.catalog = catalog
        self.package_of = package_of

    async def run(self) -> str:
        done = await self.catalog.backfilled_repositories()
        given = 0
        for repository, package_of in self.package_of.items():
            if repository in done:
                continue
            after = ""
            while True:
                keys = await self.catalog.unpackaged_entries(repository, after, BATCH_ENTRIES)
                if not keys:
                    break
                packages = await run_blocking(_packages, package_of, keys)
                await self.catalog.set_packages(repository, packages)
                given += len(packages)
                after = keys[-1]
            await self.catalog.record_backfill(repository)
        return f"gave {given} entries their package"


def _packages(
    package_of: Callable[[str], PackageVersion | None], keys: list[str]
) -> dict[str, tuple[str, str | None]]:
    found = {}
    for key in keys:
        try:
            package = package_of(key)
        except Exception:  # a format's bug must not stop the pass; the key stays unknown
            continue
        if package is not None:
            found[key] = (package.package, package.version)
    return found

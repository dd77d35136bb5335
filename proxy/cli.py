"""``proxy serve | check-config | migrate | gc | stats | mirror | jobs``.

Nothing of the proxy is imported at module level: the Prometheus client decides where
metric values live when ``proxy.runtime.metrics`` is first imported, so the metrics folder must
be settled before (``private_metrics_dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from proxy import __version__
from proxy.redaction import redact

if TYPE_CHECKING:
    from proxy.config.settings import Settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="proxy", description="Pull-through caching artifact proxy"
    )
    parser.add_argument("--version", action="version", version=f"proxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument(
        "--config", help="TOML config file (default: $PROXY_CONFIG or built-in defaults)"
    )
    serve.add_argument("--listen", help="HOST:PORT to listen on (default: server.listen)")
    serve.add_argument("--workers", type=int, help="worker processes (default: server.workers)")
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    check = commands.add_parser(
        "check-config", help="validate the config and print the effective settings"
    )
    check.add_argument("--config")

    migrate = commands.add_parser("migrate", help="apply database migrations and exit")
    migrate.add_argument("--config")

    gc = commands.add_parser("gc", help="run one reclaim pass (leases, temp files, orphan blobs)")
    gc.add_argument("--config")

    stats = commands.add_parser("stats", help="entries and bytes cached per repository")
    stats.add_argument("--config")

    mirror = commands.add_parser(
        "mirror",
        help="warm the cache now: the purls given (and an SBOM's), or every [[mirrors]]",
    )
    mirror.add_argument("--config")
    mirror.add_argument("purls", nargs="*", metavar="PURL", help="e.g. pkg:pypi/requests@2.32.3")
    mirror.add_argument("--sbom", help="a CycloneDX or SPDX JSON file: every purl it lists")
    mirror.add_argument(
        "--versions",
        choices=["latest", "all"],
        default="latest",
        help="for a purl without a version (default: latest)",
    )
    mirror.add_argument("--repository", help="mirror into this repository (default: by type)")

    jobs = commands.add_parser(
        "jobs", help="every job and schedule: interval, last run and outcome, next due"
    )
    jobs.add_argument("--config")

    args = parser.parse_args(argv)
    private_metrics_dir()
    from proxy.config.load import load
    from proxy.exceptions import ConfigError
    from proxy.runtime.logs import configure_logging

    environ = dict(os.environ)
    if getattr(args, "config", None):
        environ["PROXY_CONFIG"] = args.config
    if getattr(args, "listen", None):
        environ["PROXY_LISTEN"] = args.listen
    try:
        settings = load(None, environ)
    except ConfigError as exc:
        print("configuration errors:", file=sys.stderr)
        for error in exc.errors:
            print(f"  {redact(error)}", file=sys.stderr)
        return 2

    if args.command == "check-config":
        print(settings.describe(), end="")
        return 0
    if args.command in ("mirror", "jobs"):
        # Their output is the point; the log shows only what went wrong.
        configure_logging("warning" if args.command == "mirror" else "error")
        try:
            if args.command == "mirror":
                return asyncio.run(_mirror(settings, args))
            return asyncio.run(_jobs(settings))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    configure_logging(getattr(args, "log_level", "info"))
    if args.command == "migrate":
        return asyncio.run(_migrate(settings))
    if args.command == "gc":
        return asyncio.run(_gc(settings))
    if args.command == "stats":
        return asyncio.run(_stats(settings))
    workers = args.workers if args.workers is not None else settings.workers
    if workers < 1:
        print("--workers: must be 1 or more", file=sys.stderr)
        return 2
    # Migrate before serving: a database that cannot be reached is one clear line here,
    # not a traceback from inside the server's startup.
    if asyncio.run(_migrate(settings, quiet=True)) != 0:
        return 1
    from proxy.http import server

    try:
        return server.serve(settings, workers, args.access_log, args.log_level)
    except server.BindError as exc:
        print(exc, file=sys.stderr)
        return 1


def private_metrics_dir() -> None:
    """If the operator set ``PROMETHEUS_MULTIPROC_DIR``, use a fresh folder inside it.

    prometheus_client reads every ``*.db`` in that folder and keeps values there for the
    life of the process: a folder of our own means nothing of the operator's is read
    (another program's files would break /metrics) or removed, and nothing of ours is
    left behind. A folder that does not exist yet is created.
    """
    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not given:
        return
    try:
        os.makedirs(given, exist_ok=True)
        private = tempfile.mkdtemp(prefix=f"proxy-{os.getpid()}-", dir=given)
    except OSError as exc:
        print(f"PROMETHEUS_MULTIPROC_DIR: cannot use {given}: {exc.strerror}", file=sys.stderr)
        raise SystemExit(2) from exc
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = private
    atexit.register(shutil.rmtree, private, ignore_errors=True)


async def _migrate(settings: Settings, quiet: bool = False) -> int:
    from proxy.catalog import open_catalog
    from proxy.exceptions import CatalogError

    catalog = open_catalog(settings.database_url)
    try:
        applied = await catalog.migrate()
    except CatalogError as exc:
        print(redact(f"database.url: cannot prepare the database: {exc}"), file=sys.stderr)
        return 1
    finally:
        await catalog.close()
    if not quiet:
        print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    return 0


async def _gc(settings: Settings) -> int:
    from proxy.catalog import open_catalog
    from proxy.clock import SYSTEM_CLOCK
    from proxy.exceptions import CatalogError
    from proxy.jobs.reclaim import Reclaim
    from proxy.storage.blobs import BlobStore

    catalog = open_catalog(settings.database_url)
    try:
        await catalog.migrate()
        blobs = BlobStore(settings.storage_path)
        reclaim = Reclaim(catalog, blobs, SYSTEM_CLOCK, settings.leases.retention_s)
        summary = await reclaim.run()
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    finally:
        await catalog.close()
    print(summary)
    return 0


async def _stats(settings: Settings) -> int:
    from proxy.catalog import open_catalog
    from proxy.exceptions import CatalogError
    from proxy.units import format_size

    catalog = open_catalog(settings.database_url)
    try:
        await catalog.migrate()
        print(f"{'repository':<24} {'format':<20} {'entries':>10} {'bytes':>14}")
        for repo in settings.repositories:
            usage = await catalog.usage(repo.name)
            size = format_size(usage.bytes) if usage.bytes else "0"
            print(f"{repo.name:<24} {repo.format:<20} {usage.entries:>10} {size:>14}")
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    finally:
        await catalog.close()
    return 0


async def _mirror(settings: Settings, args: argparse.Namespace) -> int:
    from proxy.clock import SYSTEM_CLOCK
    from proxy.engine import open_engine
    from proxy.exceptions import CatalogError
    from proxy.mirror.progress import MirrorProgress
    from proxy.mirror.purls import parse_purl

    for purl in args.purls:
        try:
            parse_purl(purl)
        except ValueError as exc:
            print(f"PURL: {exc}", file=sys.stderr)
            return 2
    sbom = Path(args.sbom) if args.sbom else None
    if sbom is not None and not sbom.is_file():
        print(f"--sbom: {sbom} is not a file", file=sys.stderr)
        return 2
    if args.repository is not None and settings.repository(args.repository) is None:
        print(f"--repository: no repository {args.repository!r} in the config", file=sys.stderr)
        return 2
    if args.purls or sbom is not None:
        runs = [("cli", tuple(args.purls), sbom, args.versions, args.repository)]
    else:
        runs = [(m.name, m.packages, m.sbom, m.versions, m.repository) for m in settings.mirrors]
        if not runs:
            print("nothing to mirror: give purls or --sbom, or add [[mirrors]]", file=sys.stderr)
            return 2
    progress = MirrorProgress(sys.stdout, sys.stdout.isatty())
    try:
        async with open_engine(settings, SYSTEM_CLOCK) as engine:
            # Fetch leases like any replica: a key a serving replica is fetching is shared.
            engine.start_background(scheduler=False)
            for name, purls, sbom_path, versions, repository in runs:
                await engine.mirrors.run(name, purls, sbom_path, versions, repository, progress)
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    finally:
        progress.finish()
    s = progress.summary
    print(f"mirrored: {s.line()}")
    return 1 if s.failed or s.missing else 0


async def _jobs(settings: Settings) -> int:
    from proxy.clock import SYSTEM_CLOCK
    from proxy.engine import open_engine
    from proxy.exceptions import CatalogError
    from proxy.units import format_duration

    try:
        async with open_engine(settings, SYSTEM_CLOCK) as engine:
            scheduled = {job.name: job.interval_s for job in engine.jobs()}
            runs, now_ms = await engine.catalog.job_runs()
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    by_name = {run.name: run for run in runs}
    header = ("job", "interval", "last start", "last outcome", "next due", "holder")
    rows = [header]
    for name in [*scheduled, *sorted(set(by_name) - set(scheduled))]:
        run = by_name.get(name)
        interval_s = scheduled.get(name)
        started = run.started_at_ms if run is not None else None
        if interval_s is None:
            due = "not scheduled"
        elif started is None or started + interval_s * 1000 <= now_ms:
            due = "now"
        else:
            due = "in " + _ago(int(started + interval_s * 1000 - now_ms))
        rows.append(
            (
                name,
                format_duration(interval_s) if interval_s is not None else "-",
                f"{_when(started)} ({_ago(now_ms - started)} ago)" if started else "never",
                (run.outcome or "-") if run is not None else "-",
                due,
                run.holder if run is not None else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return 0


def _when(at_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at_ms / 1000))


def _ago(ms: int) -> str:
    seconds = max(0, ms // 1000)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"

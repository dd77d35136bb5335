"""``proxy serve | check-config | migrate | gc | stats``.

Nothing of the proxy is imported at module level: the Prometheus client decides where
metric values live when ``proxy.metrics`` is first imported, so the metrics folder must
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
from collections.abc import Sequence
from typing import TYPE_CHECKING

from proxy import __version__

if TYPE_CHECKING:
    from proxy.settings import Settings


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

    args = parser.parse_args(argv)
    private_metrics_dir()
    from proxy.config import load
    from proxy.exceptions import ConfigError
    from proxy.logs import configure_logging

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
            print(f"  {error}", file=sys.stderr)
        return 2

    if args.command == "check-config":
        print(settings.describe(), end="")
        return 0
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
    from proxy import server

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
        print(f"database.url: cannot prepare the database: {exc}", file=sys.stderr)
        return 1
    finally:
        await catalog.close()
    if not quiet:
        print("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))
    return 0


async def _gc(settings: Settings) -> int:
    from proxy.blobs import BlobStore
    from proxy.catalog import open_catalog
    from proxy.clock import SYSTEM_CLOCK
    from proxy.exceptions import CatalogError
    from proxy.jobs.reclaim import Reclaim

    catalog = open_catalog(settings.database_url)
    try:
        await catalog.migrate()
        blobs = BlobStore(settings.storage_path)
        reclaim = Reclaim(catalog, blobs, SYSTEM_CLOCK, settings.leases.retention_s)
        summary = await reclaim.run()
    except CatalogError as exc:
        print(f"database.url: {exc}", file=sys.stderr)
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
        print(f"database.url: {exc}", file=sys.stderr)
        return 1
    finally:
        await catalog.close()
    return 0

"""``proxy serve | check-config | migrate | gc | verify | stats | mirror | jobs | storage
copy | policy explain``.

Nothing of the proxy is imported at module level: the Prometheus client decides where
metric values live when ``proxy.runtime.metrics`` is first imported, so the metrics folder must
be settled before (``private_metrics_dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import json
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
    from proxy.catalog import JobRun
    from proxy.config.settings import Settings


# What each command reads: a ${VAR} in a section it never reads may stay unset.
_STORE = frozenset({"database", "storage"})
MIRROR_RUNS_SHOWN = 10  # by `proxy jobs`
NEEDS: dict[str, tuple[frozenset[str] | None, str]] = {
    "serve": (None, "all"),
    "check-config": (None, "all"),
    "migrate": (_STORE, "none"),
    "gc": (_STORE | {"leases"}, "none"),
    "verify": (_STORE, "none"),
    "stats": (_STORE, "none"),
    "jobs": (_STORE | {"jobs", "leases", "upstream", "mirrors"}, "none"),
    "mirror": (_STORE | {"leases", "upstream", "mirrors"}, "mirrors"),
    "storage": (frozenset({"storage"}), "none"),
    "policy": (_STORE | {"leases", "upstream", "policy"}, "all"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="proxy",
        description="A pull-through caching proxy for PyPI, Maven, npm, the Gradle build "
        "cache and raw files. Run `proxy COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"proxy {__version__}")
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        help="TOML config file (default: $PROXY_CONFIG, else the built-in defaults)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=summary, description=description, parents=[config])

    serve = command(
        "serve",
        "run the proxy",
        "Serve every configured repository over HTTP (HTTPS with server.tls_cert). "
        "Migrations are applied first; SIGTERM or Ctrl+C stops cleanly, handing "
        "fetch leases over to other replicas.",
    )
    serve.add_argument("--listen", metavar="HOST:PORT", help="default: server.listen")
    serve.add_argument("--workers", type=int, help="worker processes (default: server.workers)")
    serve.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one line per request (default: server.access_log, on)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text lines or one JSON object per line (default: server.log_format, text)",
    )
    command(
        "check-config",
        "validate the config and print the effective settings",
        "Print the effective settings as TOML (secrets hidden), or every error with the "
        "key that holds it (exit status 2).",
    )
    command(
        "migrate",
        "apply database migrations and exit",
        "Create or upgrade the catalog's schema (serve does it too, at start).",
    )
    command(
        "gc",
        "run one reclaim pass now",
        "Delete old lease rows, temp files of crashed downloads and blobs no entry "
        "points to (the reclaim job, once).",
    )
    verify = command(
        "verify",
        "re-hash every stored blob now; quarantine the corrupt ones",
        "Read every blob an entry names as the storage holds it (the file, or the object "
        "in the bucket) and hash it, at full speed (the scrub job does the same, paced by "
        "storage.scrub_rate). A blob whose size or sha256 is not its name's is named, "
        "with the entries naming it, and quarantined: moved aside and its entries "
        "deleted, so the next request fetches it again. Exit status 1 if a blob was "
        "corrupt, missing or unreadable.",
    )
    verify.add_argument(
        "--dry-run", action="store_true", help="name the corrupt blobs, quarantine nothing"
    )
    stats = command(
        "stats",
        "entries and bytes cached per repository",
        "What the catalog holds per repository. Never creates a catalog: in a folder "
        "without one it says so and exits 1.",
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    mirror = command(
        "mirror",
        "warm the cache now: the purls given (and an SBOM's), or every [[mirrors]]",
        "Fetch the packages that purls name into the cache, through the same fetch "
        "leases as serving replicas. Without purls or --sbom, every [[mirrors]] runs "
        "once. The run is recorded where `proxy jobs` shows it. Exit status 1 if an item "
        "failed, is missing upstream or has a purl type no repository mirrors.",
    )
    mirror.add_argument("purls", nargs="*", metavar="PURL", help="e.g. pkg:pypi/requests@2.32.3")
    mirror.add_argument("--sbom", help="a CycloneDX or SPDX JSON file: every purl it lists")
    mirror.add_argument(
        "--versions",
        choices=["latest", "all"],
        default="latest",
        help="for a purl without a version (default: latest)",
    )
    mirror.add_argument("--repository", help="mirror into this repository (default: by type)")
    mirror.add_argument("--json", action="store_true", help="print the outcome as JSON")
    jobs = command(
        "jobs",
        "every job and schedule: interval, last run and outcome, next due",
        "The fleet's background jobs and mirror runs as the catalog records them. "
        "Never creates or migrates a catalog.",
    )
    jobs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    storage = commands.add_parser(
        "storage",
        help="move the blob store",
        description="Move a folder store into a bucket without fetching anything again.",
    )
    storage_commands = storage.add_subparsers(dest="storage_command", required=True)
    copy = storage_commands.add_parser(
        "copy",
        parents=[config],
        help="copy the config's folder store into a bucket (resumable); then set storage.url",
        description="Upload every blob of the config's storage.path folder that the bucket "
        "lacks (each verified first); run it again to resume. Credentials come from the "
        "AWS environment variables or shared files.",
    )
    copy.add_argument("--to", required=True, metavar="s3://BUCKET/PREFIX/")
    copy.add_argument("--endpoint", help="the S3 endpoint URL (default: AWS)")
    copy.add_argument("--region", help="the bucket's region")
    copy.add_argument(
        "--path-style", action="store_true", help="path-style requests (most self-hosted servers)"
    )
    policy = command(
        "policy",
        "the release policy: explain its decisions",
        'What the release policy ([policy], README "Holding new releases back") decides.',
    )
    policy_commands = policy.add_subparsers(dest="policy_command", metavar="COMMAND")
    explain = policy_commands.add_parser(
        "explain",
        help="print each decision and its reason",
        description="Print what the release policy decides for each package URL, and why, "
        "without serving anything: for a purl with a version, that version; without one, "
        "every version its index lists. Publish times are asked of the upstream through "
        "the cache when need be, as `proxy mirror` does. Exit status 1 if a purl names "
        "nothing the policy judges.",
        parents=[config],
    )
    explain.add_argument("purls", nargs="+", metavar="PURL", help="e.g. pkg:pypi/requests@2.32.3")
    explain.add_argument("--repository", help="judge in this repository (default: by type)")
    explain.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader left early (`proxy jobs --json | head`): stop quietly, like other
        # Unix tools. Whatever is still buffered goes nowhere, so that exiting does
        # not fail to flush it (Python's own advice for SIGPIPE).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    private_metrics_dir()
    from proxy.config.load import Needs, load
    from proxy.exceptions import ConfigError
    from proxy.runtime.logs import configure_logging

    environ = dict(os.environ)
    if getattr(args, "config", None):
        environ["PROXY_CONFIG"] = args.config
    if getattr(args, "listen", None):
        environ["PROXY_LISTEN"] = args.listen
    if args.command == "policy" and args.policy_command is None:
        parser.parse_args(["policy", "--help"])
    sections, repositories = NEEDS[args.command]
    try:
        settings = load(None, environ, Needs(sections, repositories))
    except ConfigError as exc:
        print("configuration errors:", file=sys.stderr)
        for error in exc.errors:
            print(f"  {redact(error)}", file=sys.stderr)
        return 2

    if args.command == "check-config":
        print(settings.describe(), end="")
        return 0
    if args.command == "storage":
        configure_logging("warning")
        try:
            return asyncio.run(_storage_copy(settings, args))
        except KeyboardInterrupt:
            print("interrupted: run it again to go on where it stopped", file=sys.stderr)
            return 130
    if args.command in ("mirror", "jobs", "policy"):
        # Their output is the point; the log shows only what went wrong.
        configure_logging("error" if args.command == "jobs" else "warning")
        try:
            if args.command == "mirror":
                return asyncio.run(_mirror(settings, args))
            if args.command == "policy":
                return asyncio.run(_explain(settings, args))
            return asyncio.run(_jobs(settings, args.json))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    if args.command == "verify":
        configure_logging("warning")  # its report is the point
        try:
            return asyncio.run(_verify(settings, args.dry_run))
        except KeyboardInterrupt:
            print("interrupted: nothing more was checked", file=sys.stderr)
            return 130
    if args.command != "serve":
        configure_logging("info")
    if args.command == "migrate":
        return asyncio.run(_migrate(settings))
    if args.command == "gc":
        return asyncio.run(_gc(settings))
    if args.command == "stats":
        return asyncio.run(_stats(settings, args.json))
    return _serve(settings, args)


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    from proxy.http import server

    logs = server.LogOptions(
        level=args.log_level,
        format=args.log_format or settings.log_format,
        access=settings.access_log if args.access_log is None else args.access_log,
    )
    logs.configure()
    workers = args.workers if args.workers is not None else settings.workers
    if workers < 1:
        print("--workers: must be 1 or more", file=sys.stderr)
        return 2
    settings = dataclasses.replace(settings, workers=workers)
    # Migrate before serving: a database that cannot be reached is one clear line here,
    # not a traceback from inside the server's startup; the same for the storage.
    if asyncio.run(_migrate(settings, quiet=True)) != 0:
        return 1
    if settings.object_storage is not None and asyncio.run(_check_storage(settings)) != 0:
        return 1  # (a folder is checked by the workers as they start, and named then)
    try:
        return server.serve(settings, workers, logs)
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

    catalog = open_catalog(settings.database_url, connections=settings.database)
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


async def _check_storage(settings: Settings) -> int:
    from proxy.exceptions import StorageError
    from proxy.storage.store import open_storage

    storage = open_storage(settings)
    try:
        await storage.start()
    except StorageError as exc:
        print(f"cannot use the storage: {exc}", file=sys.stderr)
        return 1
    finally:
        await storage.close()
    return 0


async def _storage_copy(settings: Settings, args: argparse.Namespace) -> int:
    from proxy.config.load import object_storage_target
    from proxy.exceptions import ConfigError, StorageError
    from proxy.storage.blobs import BlobStore
    from proxy.storage.copy import CopyProgress, copy_folder
    from proxy.storage.s3 import Bucket

    if settings.object_storage is not None:
        print(
            f"storage copy: the config's storage is already {settings.object_storage.url}; "
            "give the config of the folder store to copy",
            file=sys.stderr,
        )
        return 2
    try:
        target = object_storage_target(
            args.to, os.environ, args.endpoint, args.region, args.path_style
        )
    except ConfigError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        return 2
    source = BlobStore(settings.storage_path)
    if not source.blobs_dir.is_dir():
        print(f"storage copy: {source.blobs_dir} is not a folder store's blobs", file=sys.stderr)
        return 2
    bucket = Bucket(target)
    progress = CopyProgress(sys.stdout, sys.stdout.isatty())
    try:
        await bucket.open()
        await bucket.check()
        summary = await copy_folder(source, bucket, progress)
    except StorageError as exc:
        progress.finish()
        print(f"storage copy: {exc}", file=sys.stderr)
        return 1
    finally:
        await bucket.close()
    progress.finish()
    print(f"copied {source.root} to {target.url}: {summary.line()}")
    if summary.failed or summary.corrupt:
        return 1
    print(f'now set storage.url = "{target.url}" (and storage.local_cache) and restart')
    return 0


async def _gc(settings: Settings) -> int:
    from proxy.catalog import open_catalog
    from proxy.clock import SYSTEM_CLOCK
    from proxy.exceptions import CatalogError, StorageError
    from proxy.jobs.reclaim import Reclaim
    from proxy.storage.store import open_storage

    # A catalog made now would name no blob, and gc deletes the blobs no entry names:
    # a database.url with a typo (or an empty database) beside the real store emptied it.
    missing = await _no_catalog(settings, current=True)
    if missing:
        print(missing, file=sys.stderr)
        return 1
    catalog = open_catalog(settings.database_url, connections=settings.database)
    storage = open_storage(settings)
    try:
        await storage.start()
        reclaim = Reclaim(catalog, storage, SYSTEM_CLOCK, settings.leases.retention_s)
        summary = await reclaim.run()
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    except StorageError as exc:
        print(f"{exc}", file=sys.stderr)
        return 1
    finally:
        await storage.close()
        await catalog.close()
    print(summary)
    return 0


async def _verify(settings: Settings, dry_run: bool) -> int:
    import logging

    from proxy.cache.quarantine import Quarantine
    from proxy.catalog import open_catalog
    from proxy.exceptions import CatalogError, StorageError
    from proxy.fetch.index import EntryIndex
    from proxy.http.bodies import HotBlobs, MarkCounts
    from proxy.jobs.scrub import Scrub, VerifyReport
    from proxy.runtime.blocking import install_io_executor
    from proxy.runtime.tasks import TaskSupervisor
    from proxy.storage.store import open_storage

    missing = await _no_catalog(settings)
    if missing:
        print(missing, file=sys.stderr)
        return 1
    # The report names every corrupt blob itself; the quarantine's log line would say it
    # twice.
    logging.getLogger("proxy.quarantine").setLevel(logging.CRITICAL)
    install_io_executor(asyncio.get_running_loop())
    catalog = open_catalog(settings.database_url, connections=settings.database)
    storage = open_storage(settings)
    tasks = TaskSupervisor()
    report = VerifyReport(sys.stdout, sys.stdout.isatty())
    try:
        await storage.start()
        quarantine = None
        if not dry_run:
            # This process's memories are empty; the serving replicas' find the file
            # gone (a shared volume) or verify the object as they read it.
            quarantine = Quarantine(catalog, storage, EntryIndex(), HotBlobs(), MarkCounts(), tasks)
        report.planned(*await catalog.stored_blob_totals())
        scrub = Scrub(catalog, storage, quarantine, rate=None, resume=False, report=report)
        await scrub.run()
    except CatalogError as exc:
        report.finish()
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    except StorageError as exc:
        report.finish()
        print(f"{exc}", file=sys.stderr)
        return 1
    finally:
        report.finish()
        await tasks.close(10.0)
        await storage.close()
        await catalog.close()
    summary = scrub.summary
    print(summary.line() + (" (dry run: nothing was quarantined)" if dry_run else ""))
    return 1 if summary.corrupt or summary.missing or summary.unreadable else 0


async def _no_catalog(settings: Settings, current: bool = False) -> str | None:
    """Why a command that reads the catalog has nothing to read, or None. ``stats``,
    ``jobs`` and ``gc`` never create a catalog: run in the wrong folder or on the wrong
    database, they must say so, not report zeros (nor, for gc, take every blob for an
    orphan). ``current``: the schema must be today's too (``jobs`` opens
    the engine, which would apply the migrations a fleet has not applied yet)."""
    from proxy.catalog import open_catalog, sqlite_path
    from proxy.exceptions import CatalogError

    hint = "`proxy serve` or `proxy migrate` creates it, or pass -c/--config"
    if settings.database_url.startswith("sqlite:"):
        path = sqlite_path(settings.database_url)
        if not path.is_file():
            return f"database.url: no catalog at {path} (nothing is cached there yet; {hint})"
    catalog = open_catalog(settings.database_url, connections=settings.database)
    try:
        pending = await catalog.pending_migrations()
    except CatalogError as exc:
        return redact(f"database.url: {exc}")
    finally:
        await catalog.close()
    if pending is None:
        return redact(f"database.url: no catalog in {settings.database_url} ({hint})")
    if pending and current:
        return (
            f"database.url: the catalog predates this version ({', '.join(pending)} not "
            "applied): run `proxy migrate` first"
        )
    return None


async def _stats(settings: Settings, as_json: bool) -> int:
    from proxy.catalog import open_catalog
    from proxy.exceptions import CatalogError
    from proxy.units import human_size

    missing = await _no_catalog(settings)
    if missing:
        print(missing, file=sys.stderr)
        return 1
    catalog = open_catalog(settings.database_url, connections=settings.database)
    rows: list[dict[str, str | int]] = []
    try:
        for repo in settings.repositories:
            usage = await catalog.usage(repo.name)
            rows.append(
                {
                    "repository": repo.name,
                    "format": repo.format,
                    "entries": usage.entries,
                    "bytes": usage.bytes,
                }
            )
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    finally:
        await catalog.close()
    if as_json:
        print(json.dumps({"repositories": rows}, indent=2))
        return 0
    _print_table(
        ("repository", "format", "entries", "size"),
        [
            (str(r["repository"]), str(r["format"]), str(r["entries"]), human_size(int(r["bytes"])))
            for r in rows
        ],
        right=(2, 3),
    )
    return 0


def _print_table(
    header: tuple[str, ...], rows: Sequence[tuple[str, ...]], right: tuple[int, ...] = ()
) -> None:
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


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
    # With --json the output is one document at the end; progress stays off the screen.
    progress = MirrorProgress(sys.stderr if args.json else sys.stdout, sys.stdout.isatty())
    run_ids: list[int] = []
    try:
        async with open_engine(settings, SYSTEM_CLOCK) as engine:
            unsupported = engine.mirrors.unsupported(args.purls, args.repository)
            if unsupported:
                for line in unsupported:
                    print(f"PURL: {line}", file=sys.stderr)
                return 1
            # Fetch leases like any replica: a key a serving replica is fetching is shared.
            engine.start_background(scheduler=False)
            for name, purls, sbom_path, versions, repository in runs:
                # Recorded where `proxy jobs`, the console and the API show runs.
                run_id, _state, _summary = await engine.mirrors.record(
                    name, "cli", purls, sbom_path, versions, repository, progress
                )
                run_ids.append(run_id)
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    finally:
        progress.finish()
    s = progress.summary
    if args.json:
        print(json.dumps({**s.as_dict(), "runs": run_ids}, indent=2))
    else:
        print(f"mirrored: {s.line()} (mirror run {', '.join(map(str, run_ids))})")
    return 1 if s.failed or s.missing or s.skipped else 0


def _outcome(run: JobRun | None) -> str:
    if run is None or run.outcome is None:
        return "-"
    return "abandoned (its pass died)" if run.abandoned else run.outcome


async def _explain(settings: Settings, args: argparse.Namespace) -> int:
    from proxy.clock import SYSTEM_CLOCK
    from proxy.engine import open_engine
    from proxy.exceptions import CatalogError, ClientError, FetchError
    from proxy.mirror.purls import parse_purl
    from proxy.policy import explain

    refs = []
    for purl in args.purls:
        try:
            refs.append(parse_purl(purl))
        except ValueError as exc:
            print(f"PURL: {exc}", file=sys.stderr)
            return 2
    if args.repository is not None and settings.repository(args.repository) is None:
        print(f"--repository: no repository {args.repository!r} in the config", file=sys.stderr)
        return 2
    status = 0
    found: list[dict[str, object]] = []
    try:
        async with open_engine(settings, SYSTEM_CLOCK) as engine:
            # Fetch leases like any replica: a key a serving replica is fetching is shared.
            engine.start_background(scheduler=False)
            policy = engine.policies.current
            for ref in refs:
                gate = engine.gate_for(ref.type, args.repository)
                if gate is None:
                    where = f"repository {args.repository!r}" if args.repository else "any"
                    judged = sorted({g.releases.purl_type for g in engine.gates.values()})
                    print(
                        f"PURL: {ref}: the release policy judges no {ref.type!r} packages in "
                        f"{where} (it judges {', '.join(judged) or 'none'})",
                        file=sys.stderr,
                    )
                    status = 1
                    continue
                try:
                    package = gate.releases.package(ref)
                    decisions = await gate.explain(package, ref.version)
                except (ClientError, FetchError) as exc:
                    print(f"PURL: {ref}: {exc}", file=sys.stderr)
                    status = 1
                    continue
                purl = gate.purl(package)
                for version, decision in decisions:
                    facts = explain.facts(decision, purl, version)
                    found.append({"repository": gate.repository, **facts})
                    if not args.json:
                        print(
                            f"{gate.repository}: {explain.sentence(decision, f'{purl}@{version}')}"
                        )
                if not decisions and not args.json:
                    print(f"{gate.repository}: {purl}: its index lists no version")
            mode = "report (nothing is withheld)" if policy.report_only else "enforce"
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"mode": settings.policy.mode, "decisions": found}, indent=2))
    else:
        print(f"mode: {mode}")
    return status


async def _jobs(settings: Settings, as_json: bool) -> int:
    from proxy.clock import SYSTEM_CLOCK
    from proxy.engine import open_engine
    from proxy.exceptions import CatalogError
    from proxy.mirror.runs import state_of
    from proxy.units import format_duration

    missing = await _no_catalog(settings, current=True)
    if missing:
        print(missing, file=sys.stderr)
        return 1
    try:
        async with open_engine(settings, SYSTEM_CLOCK) as engine:
            scheduled = {job.name: job.interval_s for job in engine.jobs()}
            runs, now_ms = await engine.catalog.job_runs()
            mirror_runs = await engine.catalog.mirror_runs(MIRROR_RUNS_SHOWN)
    except CatalogError as exc:
        print(redact(f"database.url: {exc}"), file=sys.stderr)
        return 1
    by_name = {run.name: run for run in runs}
    found = []
    for name in [*scheduled, *sorted(set(by_name) - set(scheduled))]:
        run = by_name.get(name)
        interval_s = scheduled.get(name)
        started = run.started_at_ms if run is not None else None
        due_ms: int | None = None
        if interval_s is not None:
            due_ms = now_ms if started is None else max(now_ms, started + int(interval_s * 1000))
            if run is not None and run.abandoned:
                due_ms = now_ms  # its pass died: any replica takes it up at its next check
        found.append((name, interval_s, run, started, due_ms))
    if as_json:
        print(
            json.dumps(
                {
                    "now_ms": now_ms,
                    "jobs": [
                        {
                            "name": name,
                            "interval_s": interval_s,
                            "last_started_ms": started,
                            "last_finished_ms": run.finished_at_ms if run else None,
                            "last_outcome": run.outcome if run else None,
                            "abandoned": run.abandoned if run else False,
                            "holder": run.holder if run else None,
                            "next_due_ms": due_ms,
                        }
                        for name, interval_s, run, started, due_ms in found
                    ],
                    "mirror_runs": [
                        {
                            "id": m.id,
                            "name": m.name,
                            "origin": m.origin,
                            "state": state_of(m),
                            "holder": m.holder,
                            "started_ms": m.started_at_ms,
                            "finished_ms": m.finished_at_ms,
                            **m.counts,
                            "error": m.error,
                        }
                        for m in mirror_runs
                    ],
                },
                indent=2,
            )
        )
        return 0
    rows = []
    for name, interval_s, run, started, due_ms in found:
        if due_ms is None:
            due = "not scheduled"
        elif due_ms <= now_ms:
            due = "now"
        else:
            due = "in " + _ago(due_ms - now_ms)
        rows.append(
            (
                name,
                format_duration(interval_s) if interval_s is not None else "-",
                f"{_when(started)} ({_ago(now_ms - started)} ago)" if started else "never",
                _outcome(run),
                due,
                run.holder if run is not None else "-",
            )
        )
    _print_table(("job", "interval", "last start", "last outcome", "next due", "holder"), rows)
    if mirror_runs:
        print()
        _print_table(
            ("mirror run", "name", "origin", "started", "state", "items", "holder"),
            [
                (
                    str(m.id),
                    m.name,
                    m.origin,
                    f"{_when(m.started_at_ms)} ({_ago(now_ms - m.started_at_ms)} ago)",
                    state_of(m),
                    f"{m.counts['fetched']} fetched, {m.counts['cached']} cached, "
                    f"{m.counts['failed'] + m.counts['missing']} failed",
                    m.holder,
                )
                for m in mirror_runs
            ],
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

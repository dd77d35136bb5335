"""The catalog: what is cached, where its bytes are, and who is fetching what.

One ``Catalog`` protocol, two backends chosen by the database URL scheme:
``sqlite:///`` (embedded default, ``catalog/sqlite.py``) and ``postgres://``
(``catalog/postgres.py``, for a fleet). The operations are written once
(``catalog/base.py``) over named statements, one SQL file per dialect
(``catalog/sql/``); the backends differ only in how they connect, run a transaction,
lock a job and deliver notifications (docs/architecture.md, "The catalog").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from proxy.clock import SYSTEM_CLOCK, Clock
from proxy.config.settings import DatabaseSettings
from proxy.types import Digests, Kind, Link, LinkBatch

LEASE_STATES = ("fetching", "done", "failed", "released")


# Replicas' wall clocks differ a little (NTP keeps them within milliseconds): an entry
# another replica fetched may seem to come from up to this far in the future.
CLOCK_STEP_TOLERANCE_MS = 60_000


@dataclass(frozen=True, slots=True)
class Entry:
    """A cached thing: ``(repository, key)`` -> blob and what we know about it."""

    repository: str
    key: str
    kind: Kind
    sha256: str | None  # None for negative entries
    size: int
    content_type: str | None
    fetched_at_ms: int
    expires_at_ms: int | None  # None: never expires (immutable, hosted)
    etag: str | None = None  # the upstream's validators, for conditional GETs
    last_modified: str | None = None
    digests: Digests = field(default_factory=dict)  # every digest we computed, incl. sha256
    last_access_ms: int = 0
    # Which package and version the format says the key belongs to (browsing, purges),
    # and the upstream URL the body came from; None when unknown.
    package: str | None = None
    version: str | None = None
    upstream_url: str | None = None

    def is_fresh(self, at_ms: int) -> bool:
        """Fresh at ``at_ms``. An entry that expires and seems fetched in the future
        (more than ``CLOCK_STEP_TOLERANCE_MS`` ahead: the wall clock stepped back) is
        judged stale, so a clock that jumps asks the upstream again instead of keeping a
        page fresh for however far it went back (docs/architecture.md, "Time")."""
        if self.expires_at_ms is None:
            return True
        return self.fetched_at_ms - CLOCK_STEP_TOLERANCE_MS <= at_ms < self.expires_at_ms

    def max_age_s(self, at_ms: int) -> int:
        """What is left of the entry's freshness, for Cache-Control: never more than
        its whole TTL, whatever the wall clock says now."""
        if self.expires_at_ms is None:
            return 0
        left_ms = min(self.expires_at_ms - at_ms, self.expires_at_ms - self.fetched_at_ms)
        return max(0, left_ms // 1000)

    def refreshed(
        self,
        fetched_at_ms: int,
        expires_at_ms: int | None,
        etag: str | None,
        last_modified: str | None,
    ) -> Entry:
        return replace(
            self,
            fetched_at_ms=fetched_at_ms,
            expires_at_ms=expires_at_ms,
            etag=etag or self.etag,
            last_modified=last_modified or self.last_modified,
        )


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A won claim: our mandate on ``key`` is ``fence``."""

    key: str
    holder: str
    fence: int


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What a lease holder announced of the download it is writing: the answer's type
    and length, and where to read it as it grows: the temp file's name on the shared
    volume, or (object storage) its relay's URL and this download's token."""

    file: str | None
    content_type: str | None
    length: int
    relay: str | None = None
    token: str | None = None


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """A lease as the database sees it; ``expired`` is judged by the database's clock,
    and so is ``remaining_s``, how long until it expires unless renewed (None: not
    known, as in a notification). ``renewed`` stamps the row's last claim or renewal on
    the database's clock; it is only ever compared for equality (None: not known), so a
    waiter can tell "not renewed since I first saw it" by its own monotonic clock."""

    key: str
    holder: str
    fence: int
    state: str
    expired: bool
    stream: StreamInfo | None = None
    remaining_s: float | None = None
    renewed: float | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    entries: int
    bytes: int


@dataclass(frozen=True, slots=True)
class StorageUsage:
    """Totals over every repository (docs/architecture.md, "Eviction and retention")."""

    proxied_entries: int
    proxied_bytes: int  # sizes of immutable and metadata entries
    hosted_bytes: int  # sizes of hosted entries (build caches)
    tombstoned_bytes: int  # blobs waiting out the grace period before deletion


@dataclass(frozen=True, slots=True)
class Removed:
    """An entry an eviction, retention pass or quarantine deleted."""

    repository: str
    key: str
    sha256: str | None
    size: int


@dataclass(frozen=True, slots=True)
class KnownTimes:
    """What the catalog keeps of one listed file's publish time (docs/architecture.md,
    "Release policy"): when this fleet first saw it, and the upstream's time once learnt
    from its Last-Modified."""

    first_seen_ms: int
    upstream_ms: int | None = None


@dataclass(frozen=True, slots=True)
class JobRun:
    """A job's last run as ``job_runs`` records it; times are the database's Unix ms."""

    name: str
    run_id: int
    started_at_ms: int | None  # None: never started (or its only run was given back)
    finished_at_ms: int | None
    outcome: str | None  # running, ok, failed, cancelled
    holder: str
    # Running, but no pass holds the job's lock: the pass died with its process or its
    # connection, and the run may be claimed again at once.
    abandoned: bool = False


@dataclass(frozen=True, slots=True)
class EntrySummary:
    """An entry as browsing lists it."""

    key: str
    kind: Kind
    size: int
    package: str | None
    version: str | None
    fetched_at_ms: int
    last_access_ms: int


@dataclass(frozen=True, slots=True)
class PackageSummary:
    package: str
    entries: int
    versions: int
    bytes: int
    last_access_ms: int


@dataclass(frozen=True, slots=True)
class Replica:
    """A replica's heartbeat row; ``now_ms`` is the database's clock when it was read."""

    holder: str
    host: str
    pid: int
    url: str
    version: str
    started_at_ms: int
    seen_at_ms: int
    stats: dict[str, Any]
    now_ms: int


@dataclass(frozen=True, slots=True)
class InFlight:
    """A download under a live lease, as its holder last reported it."""

    key: str  # the lease key: repository/key
    holder: str
    fence: int
    acquired_at_ms: int
    renewed_at_ms: int
    written: int | None  # bytes on disk at the last renewal
    length: int | None  # the announced length, once known
    waiters: int | None  # requests sharing it on the holder
    now_ms: int


@dataclass(frozen=True, slots=True)
class JobFailure:
    name: str
    run_id: int
    holder: str
    at_ms: int
    reason: str


@dataclass(frozen=True, slots=True)
class Purge:
    id: int
    repository: str
    package: str | None
    key: str | None


MIRROR_COUNTS = ("planned", "fetched", "cached", "missing", "failed", "skipped", "bytes")


@dataclass(frozen=True, slots=True)
class MirrorRun:
    """A mirror run as ``mirror_runs`` records it (times: the database's Unix ms)."""

    id: int
    name: str
    origin: str  # schedule | cli | api
    holder: str
    request: dict[str, Any]
    state: str  # running | ok | failed | cancelled
    cancel_requested: bool
    counts: dict[str, int]  # MIRROR_COUNTS
    started_at_ms: int
    updated_at_ms: int
    finished_at_ms: int | None
    error: str | None
    now_ms: int


class Catalog(Protocol):
    """Storage-independent operations on entries, links, fetch leases and job locks.

    Every method raises ``CatalogError`` (never a driver exception) when the database fails.
    """

    backend: str

    async def migrate(self) -> list[str]:
        """Apply pending migrations (serialized across processes); returns their names."""
        ...

    async def pending_migrations(self) -> list[str] | None:
        """The migrations not applied yet, changing nothing; None if the database holds
        no catalog at all (read-only commands must not create one)."""
        ...

    async def close(self) -> None: ...

    async def ping(self) -> None: ...

    # -- entries -------------------------------------------------------------------
    async def get_entry(self, repository: str, key: str) -> Entry | None: ...

    async def put_entry(self, entry: Entry) -> None:
        """Insert or replace (idempotent: storing the same entry twice is harmless)."""
        ...

    async def refresh_entry(self, entry: Entry) -> None:
        """Record a successful revalidation (304): new fetched/expiry times and validators."""
        ...

    async def delete_entry(self, repository: str, key: str, sha256: str | None) -> bool:
        """Delete the entry if it still points at ``sha256`` (any blob when None)."""
        ...

    async def touch_entries(self, accesses: Sequence[tuple[str, str, int]]) -> None:
        """Record last access times ``(repository, key, at_ms)`` in one batch."""
        ...

    async def usage(self, repository: str) -> Usage: ...

    async def least_recently_used(self, repository: str, limit: int) -> list[Entry]: ...

    async def unreferenced_blobs(self, sha256s: Sequence[str]) -> set[str]:
        """Those of ``sha256s`` that no entry refers to and no tombstone names (one
        statement for the whole batch: the orphan sweep's question)."""
        ...

    async def created_at_ms(self) -> int | None:
        """When this catalog was made (its first migration), or None before that. A blob
        older than its catalog was stored by another: the orphan sweep leaves it."""
        ...

    async def storage_usage(self) -> StorageUsage:
        """One aggregate over every repository."""
        ...

    async def evict_lru(self, free_bytes: int, limit: int) -> list[Removed]:
        """Delete least recently accessed proxied entries, in order, until ``free_bytes``
        are freed or ``limit`` entries are gone (one short transaction)."""
        ...

    async def expire_unused(self, repository: str, before_ms: int, limit: int) -> list[Removed]:
        """Delete up to ``limit`` proxied entries of ``repository`` last accessed before
        ``before_ms`` (one short transaction)."""
        ...

    async def drop_referenced_tombstones(self) -> int:
        """Forget tombstones whose blob an entry refers to again; how many."""
        ...

    async def due_tombstones(self, grace_s: float, after: str, limit: int) -> list[tuple[str, int]]:
        """``(sha256, size)`` of up to ``limit`` tombstones older than ``grace_s`` whose
        blob no entry refers to, in sha256 order after ``after`` (keyset pages). They
        stay until ``forget_tombstones``: the caller deletes the files first."""
        ...

    async def forget_tombstones(self, sha256s: Sequence[str]) -> int:
        """Forget the tombstones of blobs whose files are gone; how many."""
        ...

    async def delete_expired_negatives(self, older_than_ms: int) -> int: ...

    # -- stored blobs (docs/architecture.md, "Blobs verified when read") ------------------
    async def stored_blobs(self, after: str, limit: int) -> list[tuple[str, int]]:
        """``(sha256, size)`` of up to ``limit`` blobs that entries name, in sha256 order
        after ``after`` (keyset pages: the scrub's walk)."""
        ...

    async def stored_blob_totals(self) -> tuple[int, int]:
        """How many distinct blobs entries name, and their bytes."""
        ...

    async def blob_entries(self, sha256: str, limit: int) -> list[tuple[str, str]]:
        """``(repository, key)`` of up to ``limit`` entries naming the blob, in order."""
        ...

    async def delete_blob_entries(self, sha256: str) -> list[Removed]:
        """Delete every entry naming the blob (it was found corrupt), in one statement;
        the triggers tombstone it as for any deletion."""
        ...

    # -- links (files an index listed: contract.LinkStore) --------------------------------
    async def put_links(self, links: Sequence[Link] | LinkBatch) -> None: ...

    async def get_link(self, repository: str, key: str) -> Link | None: ...

    # -- publish times (docs/architecture.md, "Release policy") ----------------------------
    async def record_first_sight(self, repository: str, keys_json: str, at_ms: int) -> str:
        """Record ``at_ms`` as the first sight of each key (``keys_json``: a JSON array)
        not seen before: a key seen before keeps its time, never reset, also when its
        entry is evicted. Every key's first sight, as a JSON object (key -> Unix ms): a
        page of 100,000 files travels as two texts, not 100,000 rows."""
        ...

    async def known_times(self, repository: str, keys: Sequence[str]) -> dict[str, KnownTimes]:
        """The times kept for those of ``keys`` that have any."""
        ...

    async def record_upstream_time(
        self, repository: str, key: str, upstream_ms: int, at_ms: int
    ) -> None:
        """Keep the publish time an upstream stated for ``key`` (the first one learnt
        stays); ``at_ms`` is its first sight if it had none."""
        ...

    # -- fetch leases (docs/architecture.md, "Fetch leases") -------------------------------
    async def claim_lease(
        self,
        key: str,
        holder: str,
        ttl_s: float,
        unless_fresh: tuple[str, str, int] | None = None,
        unrenewed: tuple[int, float] | None = None,
    ) -> LeaseGrant | None:
        """One atomic claim: wins if the row is absent, expired, not 'fetching', ours,
        or still the row ``unrenewed`` = ``(fence, renewed)`` names: one the caller saw go
        unrenewed for a whole TTL by its own monotonic clock, whatever the database's
        clock says (docs/architecture.md, "Fetch leases": a clock that steps back).

        The fence comes from a global sequence, so it grows on every claim (re-entrant
        ones too) and stays monotonic after old rows are purged. Returns None if another
        holder's live 'fetching' lease stands, or if ``unless_fresh`` = ``(repository,
        key, now_ms)`` names an entry stored and fresh at ``now_ms`` (a claim that
        comes after the holder stored it: the caller waits and finds the entry). A
        claim that loses writes nothing.
        """
        ...

    async def renew_lease(
        self,
        grant: LeaseGrant,
        ttl_s: float,
        written: int | None = None,
        waiters: int | None = None,
    ) -> bool:
        """Extend our mandate; False if the row no longer carries our holder+fence+'fetching'.
        ``written`` and ``waiters`` (when given) report the download's progress with it."""
        ...

    async def release_lease(self, grant: LeaseGrant, state: str) -> bool:
        """End our mandate with ``state`` (done/failed/released), expiring the row in place.

        Matches key+holder+fence+'fetching' only, so a late release of an older mandate
        changes nothing. Never deletes the row: the fence must survive.
        """
        ...

    async def announce_stream(self, grant: LeaseGrant, stream: StreamInfo) -> bool:
        """Tell waiters which temp file our mandate is writing (only while it is ours)."""
        ...

    async def get_lease(self, key: str) -> LeaseRow | None: ...

    async def purge_leases(self, retention_s: float) -> int:
        """Delete rows expired for longer than ``retention_s``; returns how many."""
        ...

    # -- background jobs (docs/architecture.md, "Jobs") --------------------------------------
    def job_lock(self, name: str) -> AbstractAsyncContextManager[bool]:
        """Hold the fleet-wide lock for one pass of job ``name``; yields False if taken.

        On both backends the lock dies with the holder's process (Postgres: a session
        advisory lock on the session connection; SQLite: an flock on a file beside the
        database). On Postgres it also dies with that connection while the process
        lives on: the pass is then cancelled and ``JobLockLost`` raised from the block.
        A second pass of the same job in the same process gets False too.
        """
        ...

    async def claim_job_run(self, name: str, interval_s: float, holder: str) -> int | None:
        """Record a start if the last one is older than ``interval_s``, or if the last
        run is still 'running'; returns its id. Call it holding the job's lock: then a
        run still 'running' is one whose pass died. Writes nothing when not due."""
        ...

    async def give_back_job_run(self, name: str, run_id: int) -> None:
        """Undo a claim whose run was cut off, so the schedule is not skipped."""
        ...

    async def finish_job_run(self, name: str, run_id: int, outcome: str) -> None:
        """Record how run ``run_id`` ended (``ok`` or ``failed``) and when."""
        ...

    async def job_runs(self) -> tuple[list[JobRun], int]:
        """Every job's last run, and the database's clock now (Unix ms): the schedulers'
        one read per check, which writes nothing."""
        ...

    async def job_cursor(self, name: str) -> str | None:
        """Where job ``name``'s passes have got to (``save_job_cursor``), if anywhere."""
        ...

    async def save_job_cursor(self, name: str, cursor: str | None) -> None:
        """Record where the running pass of job ``name`` has got to (None: start over);
        kept in its ``job_runs`` row, so a pass cut off resumes there."""
        ...

    # -- browsing and purging (docs/architecture.md, "Operating: console, API and logs") --
    async def browse_entries(
        self, repository: str, after_key: str, limit: int
    ) -> list[EntrySummary]:
        """A keyset page of a repository's entries in key order, after ``after_key``."""
        ...

    async def search_entries(
        self, repository: str, prefix: str, after: tuple[str, str], limit: int
    ) -> list[EntrySummary]:
        """A keyset page of the entries of packages named ``prefix``..., by (package,
        key), after ``after``."""
        ...

    async def list_packages(
        self, repository: str, prefix: str, after: str, limit: int
    ) -> list[PackageSummary]: ...

    async def package_entries(
        self, repository: str, package: str, limit: int
    ) -> list[EntrySummary]: ...

    async def delete_package(self, repository: str, package: str) -> list[Removed]:
        """Delete every entry of ``package`` (negative ones too) and record the purge."""
        ...

    async def purge_entry(self, repository: str, key: str) -> bool:
        """Delete one entry, whatever its blob, and record the purge."""
        ...

    async def purges_after(self, purge_id: int) -> list[Purge]: ...

    async def unpackaged_entries(self, repository: str, after_key: str, limit: int) -> list[str]:
        """Keys stored without a package (before packages were recorded), in key order."""
        ...

    async def set_packages(
        self, repository: str, packages: dict[str, tuple[str, str | None]]
    ) -> None:
        """Give those keys their (package, version), where they still have none."""
        ...

    async def backfilled_repositories(self) -> set[str]: ...

    async def record_backfill(self, repository: str) -> None: ...

    # -- the fleet ---------------------------------------------------------------------
    async def heartbeat(self, replica: Replica) -> int:
        """Record that ``replica`` is alive (and its counters); the newest purge id."""
        ...

    async def replicas(self) -> list[Replica]: ...

    async def in_flight(self, limit: int) -> list[InFlight]: ...

    async def forget_fleet_history(self, retention_s: float) -> int:
        """Delete replicas not seen, purges and finished mirror runs older than this."""
        ...

    # -- job failures and mirror runs --------------------------------------------------
    async def record_job_failure(self, name: str, run_id: int, holder: str, reason: str) -> None:
        """Keep the reason; only the latest ``JOB_FAILURES_KEPT`` are kept."""
        ...

    async def job_failures(self, limit: int) -> list[JobFailure]: ...

    async def create_mirror_run(
        self, name: str, origin: str, holder: str, request: dict[str, Any]
    ) -> int: ...

    async def update_mirror_run(self, run_id: int, counts: dict[str, int]) -> bool:
        """Write progress; True if a cancellation was asked for."""
        ...

    async def finish_mirror_run(
        self, run_id: int, state: str, counts: dict[str, int], error: str | None
    ) -> None: ...

    async def cancel_mirror_run(self, run_id: int) -> bool:
        """Ask the replica running it to stop; False if it is not running."""
        ...

    async def mirror_run(self, run_id: int) -> MirrorRun | None: ...

    async def mirror_runs(self, limit: int) -> list[MirrorRun]: ...

    # -- notifications ------------------------------------------------------------------
    async def listen_leases(
        self,
        on_notify: Callable[[str, LeaseRow | None], None],
        on_listening: Callable[[bool], None] | None = None,
    ) -> None:
        """Deliver lease transitions until cancelled: ``on_notify(key, row)``, with the
        row as the transition left it (``expired`` False, ``remaining_s`` None), or None
        if the notification did not carry it (then the waiter reads it).

        ``on_listening(True)`` once notifications are being received (again, after a
        reconnect), ``on_listening(False)`` when they may be missed: waiters poll at the
        lease's renewal pace only in between. A backend without notifications never
        calls it, and its waiters poll at ``leases.poll_interval``."""
        ...


# Rows are read by column name (sqlite3.Row, asyncpg.Record), so a statement may select
# more or in another order; an upsert's parameters come in this order: repository, key,
# kind, sha256, size, content_type, etag, last_modified, digests (JSON text),
# fetched_at_ms, expires_at_ms, last_access_ms, package, version, upstream_url.


def entry_from_row(row: Any) -> Entry:
    return Entry(
        repository=row["repository"],
        key=row["key"],
        kind=Kind(row["kind"]),
        sha256=row["sha256"],
        size=row["size"],
        content_type=row["content_type"],
        etag=row["etag"],
        last_modified=row["last_modified"],
        digests=json.loads(row["digests"]),
        fetched_at_ms=row["fetched_at_ms"],
        expires_at_ms=row["expires_at_ms"],
        last_access_ms=row["last_access_ms"],
        package=row["package"],
        version=row["version"],
        upstream_url=row["upstream_url"],
    )


def entry_to_row(entry: Entry) -> tuple[Any, ...]:
    return (
        entry.repository,
        entry.key,
        entry.kind.value,
        entry.sha256,
        entry.size,
        entry.content_type,
        entry.etag,
        entry.last_modified,
        json.dumps(entry.digests),
        entry.fetched_at_ms,
        entry.expires_at_ms,
        entry.last_access_ms or entry.fetched_at_ms,
        entry.package,
        entry.version,
        entry.upstream_url,
    )


def open_catalog(
    database_url: str,
    clock: Clock = SYSTEM_CLOCK,
    migrations_root: Path | None = None,
    connections: DatabaseSettings | None = None,
) -> Catalog:
    """The catalog for ``database_url`` (``sqlite:///PATH`` or ``postgresql://...``).

    ``clock`` is the SQLite catalog's clock for leases and job runs; Postgres judges
    those by its own clock, so one database always has one clock. ``connections``:
    Postgres's pool size, idle timeout and session URL.
    """
    root = migrations_root or migrations_dir()
    if database_url.startswith("sqlite:"):
        from proxy.catalog.sqlite import SqliteCatalog

        return SqliteCatalog(sqlite_path(database_url), root / "sqlite", clock)
    from proxy.catalog.postgres import PostgresCatalog

    return PostgresCatalog(database_url, root / "postgres", clock, connections)


def sqlite_path(database_url: str) -> Path:
    """``sqlite:///./data/proxy.db`` -> ``./data/proxy.db``; ``sqlite:////abs`` -> ``/abs``."""
    return Path(database_url[len("sqlite:///") :])


def migrations_dir() -> Path:
    """Where the SQL migrations are: inside the wheel, or at the top of a checkout."""
    packaged = Path(__file__).resolve().parent.parent / "_migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent.parent / "migrations"


def migration_files(folder: Path) -> list[tuple[int, str, str]]:
    """``(version, name, sql)`` of every ``NNNN_name.sql`` in ``folder``, in order."""
    found = []
    for path in sorted(folder.glob("*.sql")):
        number, _, _ = path.stem.partition("_")
        if not number.isdigit():
            raise ValueError(f"migration {path.name}: name must start with a number")
        found.append((int(number), path.stem, path.read_text(encoding="utf-8")))
    return found

"""Every Prometheus metric the proxy exports, defined once.

With several worker processes (``proxy serve --workers N``) the CLI sets
``PROMETHEUS_MULTIPROC_DIR`` before this module is imported, and ``/metrics``
aggregates the per-process files (see ``render``).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client import multiprocess as _multiprocess

# `_created` series double the exposition size and nobody graphs them.
disable_created_metrics()  # type: ignore[no-untyped-call]

REQUESTS = Counter(
    "proxy_http_requests_total",
    "HTTP requests answered, by repository, method and status",
    ["repository", "method", "status"],
)
REQUEST_DURATION = Histogram(
    "proxy_http_request_duration_seconds",
    "Time from request to the last body byte sent",
    ["repository"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CACHE_HITS = Counter(
    "proxy_cache_hits_total",
    "Requests served from the cache",
    ["repository", "format", "kind"],
)
CACHE_MISSES = Counter(
    "proxy_cache_misses_total",
    "Requests that needed the upstream (absent or expired)",
    ["repository", "format", "kind"],
)
NEGATIVE_HITS = Counter(
    "proxy_negative_hits_total",
    "404s answered from a cached confirmed upstream miss",
    ["repository"],
)
STALE_SERVED = Counter(
    "proxy_stale_served_total",
    "Expired metadata served because the upstream failed (stale-if-error)",
    ["repository"],
)
BYTES_SERVED = Counter(
    "proxy_bytes_served_total",
    "Body bytes sent to clients",
    ["repository"],
)
UPSTREAM_BYTES = Counter(
    "proxy_upstream_bytes_total",
    "Body bytes received from upstreams",
    ["repository"],
)
UPSTREAM_FETCH_DURATION = Histogram(
    "proxy_upstream_fetch_duration_seconds",
    "Duration of upstream fetches, by outcome (stored, not_modified, not_found, "
    "passed_through, storage_full: its body refused for storage.min_free, error)",
    ["repository", "outcome"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
UPSTREAM_ERRORS = Counter(
    "proxy_upstream_errors_total",
    "Upstream failures seen (each attempt), by upstream host and reason",
    ["host", "reason"],
)
UPSTREAM_CIRCUIT_STATE = Gauge(
    "proxy_upstream_circuit_state",
    "Outage memory per upstream host: 0 closed (up), 1 half-open (probing), 2 open (down)",
    ["host"],
    multiprocess_mode="max",  # with several workers: the worst any worker sees
)
FETCHES_IN_FLIGHT = Gauge(
    "proxy_fetches_in_flight",
    "Upstream fetches running in this process",
    ["repository"],
    multiprocess_mode="livesum",
)
COALESCED_WAITERS = Counter(
    "proxy_coalesced_waiters_total",
    "Requests that joined a fetch already running in the same process",
    ["repository"],
)
CONTENT_REFUSED = Counter(
    "proxy_content_refused_total",
    "Unverified upstream bodies refused by their content check (an HTML page for a jar...)",
    ["repository"],
)
DIGEST_MISMATCHES = Counter(
    "proxy_digest_mismatches_total",
    "Upstream bodies refused because they did not match their listed digest",
    ["repository"],
)

LEASE_WAITS = Counter(
    "proxy_fetch_lease_waits_total",
    "Misses that waited on another process's fetch lease",
    ["repository"],
)
LEASE_CLAIMS = Counter(
    "proxy_fetch_lease_claims_total",
    "Fetch lease claims, by result (won, held_elsewhere)",
    ["repository", "result"],
)
LEASE_TAKEOVERS = Counter(
    "proxy_fetch_lease_takeovers_total",
    "Leases taken over after the holder released them without an entry or stopped renewing",
    ["repository"],
)
LEASE_LOSSES = Counter(
    "proxy_fetch_lease_losses_total",
    "Held leases lost (a renewal matched no row, or none succeeded within the TTL)",
    ["repository"],
)
LEASE_FAILED_MARKS = Counter(
    "proxy_fetch_lease_failed_marks_total",
    "Leases released as 'failed' because the upstream fetch failed",
    ["repository"],
)
LEASE_WAIT_DURATION = Histogram(
    "proxy_fetch_lease_wait_duration_seconds",
    "Time spent waiting on another process's lease, by how the wait ended",
    ["repository", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
LEASE_NOTIFICATIONS = Counter(
    "proxy_fetch_lease_notifications_total",
    "Lease transition notifications received (Postgres LISTEN/NOTIFY)",
)
LEASES_PURGED = Counter(
    "proxy_fetch_leases_purged_total",
    "Expired lease rows deleted by the reclaim job",
)

BACKGROUND_TASK_FAILURES = Counter(
    "proxy_background_task_failures_total",
    "Background tasks that died with an error",
    ["task"],
)
JOB_RUNS = Counter(
    "proxy_job_runs_total",
    "Background job passes, by outcome (ran, skipped_locked, failed, cancelled, lock_lost)",
    ["job", "outcome"],
)
STORAGE_ERRORS = Counter(
    "proxy_storage_errors_total",
    "Blob storage operations that failed, by operation and errno (ENOSPC, EIO, ...)",
    ["operation", "errno"],
)
STORAGE_REQUESTS = Counter(
    "proxy_storage_requests_total",
    "Requests sent to the object storage (every attempt), by operation (get, put, "
    "upload_part, list, delete, ...)",
    ["operation"],
)
RELAY_REQUESTS = Counter(
    "proxy_relay_requests_total",
    "Requests to this process's relay, by result (served, forbidden: a wrong token, "
    "unknown: no download under that fence, failed)",
    ["result"],
)
RELAY_FOLLOWS = Counter(
    "proxy_relay_follows_total",
    "Other replicas' relays followed, by result (started, refused: the announced URL is no "
    "relay's, unproven: the answer lacked the relay's proof)",
    ["result"],
)
EVENT_LOOP_LAG = Histogram(
    "proxy_event_loop_lag_seconds",
    "How late the event loop ran a periodic probe (time it was busy with something else)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
JOB_LAST_SUCCESS = Gauge(
    "proxy_job_last_success_timestamp_seconds",
    "When a pass of the job last ended successfully in this process (Unix time)",
    ["job"],
    multiprocess_mode="max",
)
DATABASE_RECONNECTS = Counter(
    "proxy_database_reconnects_total",
    "Connections to Postgres made again after one was lost (restart, failover, a "
    "terminated backend), by connection: session (LISTEN, job locks) or pool",
    ["connection"],
)
JOB_LOCKS_LOST = Counter(
    "proxy_job_locks_lost_total",
    "Job passes stopped because the session connection holding their lock was lost",
    ["job"],
)
CATALOG_ERRORS = Counter(
    "proxy_catalog_errors_total",
    "Database operations that failed",
    ["operation"],
)
ENTRIES_EVICTED = Counter(
    "proxy_entries_evicted_total",
    "Entries removed to keep a repository under its max_size",
    ["repository"],
)
REPOSITORY_SIZE = Gauge(
    "proxy_repository_size_bytes",
    "Bytes of entries in a repository, as last measured by a sweep",
    ["repository"],
    multiprocess_mode="mostrecent",
)
EVICTED_ENTRIES = Counter(
    "proxy_evicted_entries_total",
    "Proxied entries removed, by reason (size: over storage.max_size; retention: unused)",
    ["reason"],
)
EVICTED_BYTES = Counter(
    "proxy_evicted_bytes_total",
    "Bytes of the proxied entries removed, by reason (size, retention)",
    ["reason"],
)
BLOBS_DELETED = Counter(
    "proxy_tombstoned_blobs_deleted_total",
    "Blob files deleted after their grace period (jobs.evict_grace)",
)
BLOBS_QUARANTINED = Counter(
    "proxy_blobs_quarantined_total",
    "Stored copies of blobs found corrupt and never served again, by reason (size: not "
    "the entry's length; digest: not its sha256; type: not a regular file)",
    ["reason"],
)
SCRUB_BYTES = Counter(
    "proxy_scrub_bytes_total",
    "Bytes of stored blobs re-hashed by the scrub job and proxy verify",
)
SCRUB_SLEEP = Counter(
    "proxy_scrub_sleep_seconds_total",
    "Seconds the scrub slept between reads to keep to storage.scrub_rate",
)
STORAGE_BYTES = Gauge(
    "proxy_storage_bytes",
    "Bytes of entries by kind (proxied, hosted) and of blobs waiting out their grace "
    "(tombstoned), as last measured",
    ["kind"],
    multiprocess_mode="mostrecent",
)
STORAGE_MAX_BYTES = Gauge(
    "proxy_storage_max_bytes",
    "storage.max_size: the bound of the proxied entries (absent when unset)",
    multiprocess_mode="mostrecent",
)
MIRROR_ITEMS = Counter(
    "proxy_mirror_items_total",
    "Items of mirror runs, by outcome (fetched, cached, missing, failed, skipped)",
    ["mirror", "outcome"],
)
POLICY_DECISIONS = Counter(
    "proxy_policy_decisions_total",
    "Release-policy decisions applied to requests: a file request counts its version's "
    "decision, an index document each version it withholds (or would, in report mode); "
    "rule is a rule's name or index, or cooldown, exclude_newer, unknown_publish_time, none",
    ["repository", "action", "rule"],
)
POLICY_RELOADS = Counter(
    "proxy_policy_reloads_total",
    "Reloads of [policy] on SIGHUP, by outcome (ok, or failed: the old policy stays)",
    ["outcome"],
)
UPLOADS = Counter(
    "proxy_uploads_total",
    "Uploads (build cache PUTs), by result (stored, too_large, unauthorized, forbidden)",
    ["repository", "result"],
)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def render() -> tuple[bytes, str]:
    """The exposition text for /metrics, aggregated over worker processes if any."""
    path = multiprocess_dir()
    if path:
        registry = CollectorRegistry()
        _multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST


def mark_process_dead(pid: int) -> None:
    if multiprocess_dir():
        _multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


class Batched:
    """Counts and observations of one request metric set, kept as plain numbers and
    added to Prometheus's values in one go (``flush``): the hit lane answers tens of
    thousands of requests a second, and each ``inc``/``observe`` takes a lock
    (``http/lane.py``). ``observe`` sorts into the histogram's own buckets, and
    ``flush`` adds each bucket's count as ``Histogram.observe`` would one by one (its
    children's ``_sum``, ``_buckets`` and ``_upper_bounds``: prometheus_client's
    layout, pinned in requirements.lock and checked by tests/test_hit_lane.py)."""

    __slots__ = (
        "_bounds",
        "_buckets",
        "_bytes",
        "_counter",
        "_histogram",
        "_sum",
        "bytes",
        "count",
    )

    def __init__(self, counter: Any, histogram: Any, bytes_counter: Any) -> None:
        """``counter``: requests; ``histogram``: their durations; ``bytes_counter``:
        their body bytes (children of the labels they are for)."""
        self._counter = counter
        self._histogram = histogram
        self._bytes = bytes_counter
        self.bytes = 0
        self.count = 0
        self._bounds: tuple[float, ...] = tuple(histogram._upper_bounds)
        self._buckets = [0] * len(self._bounds)
        self._sum = 0.0

    def add(self, seconds: float, sent: int) -> None:
        self.count += 1
        self.bytes += sent
        self._sum += seconds
        for i, bound in enumerate(self._bounds):
            if seconds <= bound:
                self._buckets[i] += 1
                break

    def flush(self) -> None:
        if not self.count:
            return
        self._counter.inc(self.count)
        if self.bytes:
            self._bytes.inc(self.bytes)
        self._histogram._sum.inc(self._sum)
        for i, n in enumerate(self._buckets):
            if n:
                self._histogram._buckets[i].inc(n)
                self._buckets[i] = 0
        self.count = self.bytes = 0
        self._sum = 0.0

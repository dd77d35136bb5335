"""What the console and the admin API show, gathered once for both
(docs/architecture.md, "Operating: console, API and logs").

Fleet-wide numbers come from the catalog, which every replica writes cheaply: entries
and bytes from ``entries``, hits, misses and upstream health from each replica's
heartbeat row (``proxy/fleet.py``), downloads in progress from the lease rows (their
holders report progress with each renewal), job runs from ``job_runs`` and
``job_failures``, mirror runs from ``mirror_runs``. Values are plain dicts: the API
answers them as JSON, the console renders them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from dataclasses import replace
from typing import Any

from proxy.catalog import EntrySummary, MirrorRun, Replica, StorageUsage
from proxy.engine import Engine
from proxy.exceptions import BadRequest, CatalogError, Conflict, NotFound, describe_os_error
from proxy.fetch.leases import lease_key
from proxy.fleet import REPLICA_GONE_AFTER_S
from proxy.mirror.runs import state_of
from proxy.redaction import redact
from proxy.runtime.blocking import run_blocking
from proxy.types import Kind

PAGE_SIZE_DEFAULT = 50
PAGE_SIZE_MAX = 500
PACKAGE_ENTRIES_MAX = 2000
IN_FLIGHT_SHOWN = 200
RECENT_FAILURES = 20
RECENT_MIRROR_RUNS = 20
USAGE_CACHE_S = 10.0  # counting a repository of millions of entries takes a while
DATABASE_CHECK_TIMEOUT_S = 2.0


class Overview:
    """One engine's view of the fleet, with the slow counts cached for a few seconds."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._usage: tuple[float, dict[str, tuple[int, int]]] | None = None
        self._usage_lock = asyncio.Lock()
        self._totals: tuple[float, StorageUsage] | None = None

    # -- the fleet ------------------------------------------------------------------------

    async def usage(self) -> dict[str, tuple[int, int]]:
        """(entries, bytes) per repository, at most ``USAGE_CACHE_S`` old."""
        async with self._usage_lock:
            if self._usage is not None and time.monotonic() - self._usage[0] < USAGE_CACHE_S:
                return self._usage[1]
            found = {}
            for repo in self.engine.settings.repositories:
                usage = await self.engine.catalog.usage(repo.name)
                found[repo.name] = (usage.entries, usage.bytes)
            self._usage = (time.monotonic(), found)
            return found

    async def _storage_totals(self) -> StorageUsage:
        """The proxied/hosted/tombstoned totals, at most ``USAGE_CACHE_S`` old."""
        if self._totals is not None and time.monotonic() - self._totals[0] < USAGE_CACHE_S:
            return self._totals[1]
        totals = await self.engine.catalog.storage_usage()
        self._totals = (time.monotonic(), totals)
        return totals

    async def replicas(self) -> list[dict[str, Any]]:
        return [_replica(r) for r in await self.engine.catalog.replicas()]

    async def _replica_rows(self) -> list[Replica]:
        """Every replica's row, with this replica's counters as they are now (its row
        is up to one heartbeat old)."""
        rows = await self.engine.catalog.replicas()
        live = self.engine.heartbeat().replica().stats
        return [replace(r, stats=live) if r.holder == self.engine.holder else r for r in rows]

    async def stats(self) -> dict[str, Any]:
        """Per repository: entries, bytes, hits and misses (fleet-wide), size limits."""
        usage = await self.usage()
        replicas = await self._replica_rows()
        settings = self.engine.settings
        repositories = []
        for repo in settings.repositories:
            hits = sum(int(r.stats.get("hits", {}).get(repo.name, 0)) for r in replicas)
            misses = sum(int(r.stats.get("misses", {}).get(repo.name, 0)) for r in replicas)
            entries, size = usage.get(repo.name, (0, 0))
            repositories.append(
                {
                    "name": repo.name,
                    "format": repo.format,
                    "entries": entries,
                    "bytes": size,
                    "max_size": self.engine.size_limits.get(repo.name),
                    "hits": hits,
                    "misses": misses,
                    "hit_ratio": hits / (hits + misses) if hits + misses else None,
                    "upstreams": [redact(u) for u in repo.upstreams],
                    "configured": repo.name not in self.engine.not_configured,
                    "packages": repo.name in self.engine.package_of,
                    # Proxied entries count toward storage.max_size (hosted ones do not).
                    "shared_limit": bool(repo.upstreams) or repo.name in self.engine.not_configured,
                }
            )
        return {"repositories": repositories}

    async def storage(self) -> dict[str, Any]:
        """The database and the storage volume, as /readyz judges them, and the proxied
        total against ``storage.max_size``."""
        engine = self.engine
        database: dict[str, Any] = {"backend": engine.catalog.backend}
        started = time.perf_counter()
        try:
            async with asyncio.timeout(DATABASE_CHECK_TIMEOUT_S):
                await engine.catalog.ping()
                totals = await self._storage_totals()
            database |= {"ok": True, "latency_ms": (time.perf_counter() - started) * 1000}
        except (CatalogError, TimeoutError) as exc:
            database |= {"ok": False, "error": redact(str(exc) or "timed out")}
            totals = None
        # The folder this process writes (on object storage, its local tier), and the
        # bucket as /readyz judges it (cached, a LIST of one key at most every 5 s).
        storage: dict[str, Any] = {"path": str(engine.blobs.root)}
        try:
            await run_blocking(engine.blobs.check_writable)
            free = await run_blocking(engine.blobs.free_bytes)
            storage |= {"writable": True, "free_bytes": free}
            storage["ok"] = free >= engine.settings.storage.min_free
        except OSError as exc:
            storage |= {"writable": False, "ok": False, "error": describe_os_error(exc)}
        bucket = engine.settings.object_storage
        if bucket is not None:
            storage["url"] = bucket.url
            problems = await engine.storage.problems(engine.settings.storage.min_free)
            if problems and storage["ok"]:
                storage |= {"ok": False, "error": redact("; ".join(problems))}
        storage["min_free"] = engine.settings.storage.min_free
        storage["max_size"] = engine.settings.storage.max_size
        if totals is not None:
            storage |= {
                "proxied_entries": totals.proxied_entries,
                "proxied_bytes": totals.proxied_bytes,
                "hosted_bytes": totals.hosted_bytes,
                "tombstoned_bytes": totals.tombstoned_bytes,
            }
        return {"database": database, "storage": storage}

    async def upstream_health(self) -> list[dict[str, Any]]:
        """Per upstream host, merged over the replicas' heartbeats."""
        merged: dict[str, dict[str, Any]] = {}
        for replica in await self._replica_rows():
            if replica.now_ms - replica.seen_at_ms > REPLICA_GONE_AFTER_S * 1000:
                continue
            for host, health in replica.stats.get("upstreams", {}).items():
                into = merged.setdefault(
                    host,
                    {"host": host, "answers": 0, "failures": 0, "last_answer_ms": None,
                     "last_failure_ms": None, "last_error": None, "circuit": "closed"},
                )  # fmt: skip
                # Any replica's open circuit shows: that one fails fast now.
                if health.get("circuit", "closed") != "closed":
                    into["circuit"] = health["circuit"]
                into["answers"] += int(health.get("answers", 0))
                into["failures"] += int(health.get("failures", 0))
                for when in ("last_answer_ms", "last_failure_ms"):
                    value = health.get(when)
                    if value is not None and (into[when] is None or value > into[when]):
                        into[when] = value
                        if when == "last_failure_ms":
                            into["last_error"] = health.get("last_error")
        for health in merged.values():
            answer, failure = health["last_answer_ms"], health["last_failure_ms"]
            health["ok"] = failure is None or (answer is not None and answer > failure)
        return sorted(merged.values(), key=lambda h: str(h["host"]))

    async def in_flight(self) -> list[dict[str, Any]]:
        rows = await self.engine.catalog.in_flight(IN_FLIGHT_SHOWN)
        found = []
        for row in rows:
            elapsed_s = max(0.001, (row.renewed_at_ms - row.acquired_at_ms) / 1000)
            found.append(
                {
                    "key": row.key,
                    "holder": row.holder,
                    "fence": row.fence,
                    "started_ms": row.acquired_at_ms,
                    "age_s": (row.now_ms - row.acquired_at_ms) / 1000,
                    "bytes": row.written,
                    "length": row.length,
                    # Bytes at the last renewal over the time to it: no statement of its own.
                    "rate": (row.written / elapsed_s) if row.written else None,
                    "waiters": row.waiters,
                }
            )
        return found

    async def jobs(self) -> dict[str, Any]:
        engine = self.engine
        scheduled = {job.name: job.interval_s for job in engine.jobs()}
        runs, now_ms = await engine.catalog.job_runs()
        by_name = {run.name: run for run in runs}
        jobs = []
        for name in [*scheduled, *sorted(set(by_name) - set(scheduled))]:
            run = by_name.get(name)
            interval_s = scheduled.get(name)
            started = run.started_at_ms if run is not None else None
            due = None
            if interval_s is not None:
                due = now_ms if started is None else max(now_ms, started + int(interval_s * 1000))
            jobs.append(
                {
                    "name": name,
                    "interval_s": interval_s,
                    "last_started_ms": started,
                    "last_finished_ms": run.finished_at_ms if run else None,
                    "last_outcome": run.outcome if run else None,
                    "holder": run.holder if run else None,
                    "next_due_ms": due,
                }
            )
        failures = [
            {"name": f.name, "run_id": f.run_id, "holder": f.holder, "at_ms": f.at_ms,
             "reason": f.reason}
            for f in await engine.catalog.job_failures(RECENT_FAILURES)
        ]  # fmt: skip
        mirror_runs = [
            mirror_run_dict(run) for run in await engine.catalog.mirror_runs(RECENT_MIRROR_RUNS)
        ]
        return {"now_ms": now_ms, "jobs": jobs, "failures": failures, "mirror_runs": mirror_runs}

    async def mirror_run(self, run_id: int) -> dict[str, Any]:
        run = await self.engine.catalog.mirror_run(run_id)
        if run is None:
            raise NotFound(f"no mirror run {run_id}")
        return mirror_run_dict(run)

    # -- what is cached -------------------------------------------------------------------

    def repository(self, name: str | None) -> str:
        """A configured repository's name, or ``BadRequest``/``NotFound`` naming them."""
        known = [r.name for r in self.engine.settings.repositories]
        if not name:
            raise BadRequest(f"give a repository: one of {', '.join(known) or 'none'}")
        if name not in known:
            raise NotFound(f"no repository named {name!r}; configured: {', '.join(known)}")
        return name

    async def entries(
        self, repository: str, q: str, after: str | None, limit: int
    ) -> dict[str, Any]:
        """A keyset page: a repository's entries in key order, or with ``q`` the entries
        of packages whose name starts with it. ``next`` is the cursor of the next page."""
        limit = max(1, min(limit, PAGE_SIZE_MAX))
        cursor = decode_cursor(after)
        q = self.package_name(repository, checked_text(q, "q"))
        if q:
            start = (cursor[0], cursor[1]) if len(cursor) == 2 else (q, "")
            rows = await self.engine.catalog.search_entries(repository, q, start, limit + 1)
            next_cursor = (
                [rows[limit - 1].package or "", rows[limit - 1].key] if len(rows) > limit else None
            )
        else:
            start_key = cursor[0] if len(cursor) == 1 else ""
            rows = await self.engine.catalog.browse_entries(repository, start_key, limit + 1)
            next_cursor = [rows[limit - 1].key] if len(rows) > limit else None
        return {
            "repository": repository,
            "q": q,
            "entries": [summary_dict(row) for row in rows[:limit]],
            "next": encode_cursor(next_cursor) if next_cursor else None,
        }

    async def packages(
        self, repository: str, q: str, after: str | None, limit: int
    ) -> dict[str, Any]:
        limit = max(1, min(limit, PAGE_SIZE_MAX))
        cursor = decode_cursor(after)
        q = self.package_name(repository, checked_text(q, "q"))
        rows = await self.engine.catalog.list_packages(
            repository, q, cursor[0] if len(cursor) == 1 else "", limit + 1
        )
        return {
            "repository": repository,
            "q": q,
            "packages": [
                {
                    "package": r.package,
                    "entries": r.entries,
                    "versions": r.versions,
                    "bytes": r.bytes,
                    "last_access_ms": r.last_access_ms,
                }
                for r in rows[:limit]
            ],
            "next": encode_cursor([rows[limit - 1].package]) if len(rows) > limit else None,
        }

    async def package(self, repository: str, package: str) -> dict[str, Any]:
        package = self.named_package(repository, package)
        rows = await self.engine.catalog.package_entries(repository, package, PACKAGE_ENTRIES_MAX)
        if not rows:
            raise NotFound(f"nothing of package {package!r} is cached in {repository}")
        versions: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            versions.setdefault(row.version or "", []).append(summary_dict(row))
        return {
            "repository": repository,
            "package": package,
            "entries": len(rows),
            "bytes": sum(r.size for r in rows),
            "versions": [
                {"version": version or None, "entries": entries}
                for version, entries in sorted(versions.items(), key=lambda kv: kv[0], reverse=True)
            ],
        }

    async def entry(self, repository: str, key: str) -> dict[str, Any]:
        key = checked_text(key, "key")
        entry = await self.engine.catalog.get_entry(repository, key)
        if entry is None:
            raise NotFound(f"no entry {key!r} in {repository}")
        return {
            "repository": entry.repository,
            "key": entry.key,
            "kind": entry.kind.value,
            "size": entry.size,
            "content_type": entry.content_type,
            "sha256": entry.sha256,
            "digests": dict(entry.digests),
            "package": entry.package,
            "version": entry.version,
            "upstream_url": redact(entry.upstream_url) if entry.upstream_url else None,
            "fetched_at_ms": entry.fetched_at_ms,
            "expires_at_ms": entry.expires_at_ms,
            "last_access_ms": entry.last_access_ms,
            "etag": entry.etag,
            "last_modified": entry.last_modified,
            # Whether and why the release policy lets the entry be served (None: no
            # policy could withhold anything in this repository).
            "policy": await self.engine.release_decision(repository, entry.key),
        }

    # -- acting on it ---------------------------------------------------------------------

    async def purge_package(self, repository: str, package: str) -> dict[str, Any]:
        if repository not in self.engine.package_of:
            raise BadRequest(
                f"repository {repository!r} ({self._format(repository)}) does not group its "
                "entries by package; purge entries one by one"
            )
        package = self.named_package(repository, package)
        removed = await self.engine.catalog.delete_package(repository, package)
        for gone in removed:
            self.engine.cache.index.drop(repository, gone.key)
        self._usage = self._totals = None
        return {
            "repository": repository,
            "package": package,
            "deleted": len(removed),
            "bytes": sum(r.size for r in removed),
        }

    async def purge_entry(self, repository: str, key: str) -> dict[str, Any]:
        key = checked_text(key, "key")
        deleted = await self.engine.catalog.purge_entry(repository, key)
        self.engine.cache.index.drop(repository, key)
        if not deleted:
            # Nothing stored yet may be a download in flight, which stores it when it
            # ends: "no entry" would read as "gone" a moment before it is there.
            lease = await self.engine.catalog.get_lease(lease_key(repository, key))
            if lease is not None and lease.state == "fetching" and not lease.expired:
                raise Conflict(
                    f"{key!r} in {repository} is being downloaded (by {lease.holder}) and "
                    "is stored when that ends: purge it then"
                )
            raise NotFound(f"no entry {key!r} in {repository}")
        self._usage = self._totals = None
        return {"repository": repository, "key": key, "deleted": 1}

    def package_name(self, repository: str, text: str) -> str:
        """A package name (or a name's prefix) as the repository stores it: a person
        types "Django" or "flask_cors" for PyPI's django and flask-cors."""
        spelling = self.engine.package_names.get(repository)
        return spelling(text) if spelling is not None else text

    def named_package(self, repository: str, text: str) -> str:
        """``package_name`` of a whole name, or ``BadRequest`` for none at all."""
        name = self.package_name(repository, checked_text(text, "package"))
        if not name:
            raise BadRequest(f"give a package name: /{repository}/NAME")
        return name

    def _format(self, repository: str) -> str:
        repo = self.engine.settings.repository(repository)
        return repo.format if repo is not None else "?"


def _replica(row: Replica) -> dict[str, Any]:
    age_s = (row.now_ms - row.seen_at_ms) / 1000
    return {
        "holder": row.holder,
        "host": row.host,
        "pid": row.pid,
        "url": row.url,
        "version": row.version,
        "started_ms": row.started_at_ms,
        "seen_ms": row.seen_at_ms,
        "seen_s_ago": age_s,
        "alive": age_s <= REPLICA_GONE_AFTER_S,
    }


def mirror_run_dict(run: MirrorRun) -> dict[str, Any]:
    state = state_of(run)
    return {
        "id": run.id,
        "name": run.name,
        "origin": run.origin,
        "holder": run.holder,
        "request": run.request,
        "state": state,
        "cancel_requested": run.cancel_requested,
        **run.counts,
        "started_ms": run.started_at_ms,
        "updated_ms": run.updated_at_ms,
        "finished_ms": run.finished_at_ms,
        "error": run.error,
    }


def summary_dict(row: EntrySummary) -> dict[str, Any]:
    return {
        "key": row.key,
        "kind": row.kind.value,
        "size": row.size if row.kind is not Kind.NEGATIVE else None,
        "package": row.package,
        "version": row.version,
        "fetched_at_ms": row.fetched_at_ms,
        "last_access_ms": row.last_access_ms,
    }


def encode_cursor(values: list[str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")


def decode_cursor(text: str | None) -> list[str]:
    """The values a ``next`` cursor carries; ``BadRequest`` for anything we did not make."""
    if not text:
        return []
    try:
        values = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (ValueError, binascii.Error):
        raise BadRequest(f"after={text!r} is not a cursor this proxy gave out") from None
    if not isinstance(values, list) or not 1 <= len(values) <= 2:
        raise BadRequest(f"after={text!r} is not a cursor this proxy gave out")
    if not all(isinstance(v, str) and _storable(v) for v in values):
        raise BadRequest(f"after={text!r} is not a cursor this proxy gave out")
    return values


def checked_text(value: str, what: str) -> str:
    """``value`` (a search, a key, a package name from a client), or ``BadRequest`` if
    it holds what no stored key or name can: a NUL (Postgres refuses it in text) or a
    lone surrogate (no UTF-8 encodes it; both backends refuse it)."""
    if not _storable(value):
        raise BadRequest(f"{what} {value!r} holds a character no key or package name has")
    return value


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True

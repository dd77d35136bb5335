-- Named statements of the SQLite catalog (loaded by proxy/catalog/queries.py).
-- Each "-- name: x" starts a statement; the same name in postgres.sql has the same meaning
-- and the same numbered parameters. Times are Unix milliseconds; clock_ms() is the
-- catalog's clock (a function the connection registers, so tests can move it).

-- name: ping
SELECT 1

-- name: select_clock
-- The database's clock, Unix ms.
SELECT clock_ms() AS now_ms

-- name: create_schema_migrations
CREATE TABLE IF NOT EXISTS schema_migrations
    (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)

-- name: applied_migrations
SELECT version FROM schema_migrations

-- name: migrations_table
-- 1 if the database has a catalog's schema_migrations table (read without creating it).
SELECT count(*) AS present FROM sqlite_master
WHERE type = 'table' AND name = 'schema_migrations'

-- name: record_migration
INSERT INTO schema_migrations VALUES (?1, ?2, clock_ms())

-- name: select_entry
SELECT repository, key, kind, sha256, size, content_type, etag, last_modified, digests,
       fetched_at_ms, expires_at_ms, last_access_ms, package, version, upstream_url
FROM entries WHERE repository = ?1 AND key = ?2

-- name: upsert_entry
INSERT INTO entries (repository, key, kind, sha256, size, content_type, etag, last_modified,
                     digests, fetched_at_ms, expires_at_ms, last_access_ms, package, version,
                     upstream_url)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14,
        ?15)
ON CONFLICT (repository, key) DO UPDATE SET
    kind = excluded.kind, sha256 = excluded.sha256, size = excluded.size,
    content_type = excluded.content_type, etag = excluded.etag,
    last_modified = excluded.last_modified, digests = excluded.digests,
    fetched_at_ms = excluded.fetched_at_ms, expires_at_ms = excluded.expires_at_ms,
    last_access_ms = max(entries.last_access_ms, excluded.last_access_ms),
    package = coalesce(excluded.package, entries.package),
    version = coalesce(excluded.version, entries.version),
    upstream_url = coalesce(excluded.upstream_url, entries.upstream_url)

-- name: refresh_entry
UPDATE entries SET fetched_at_ms = ?1, expires_at_ms = ?2, etag = ?3, last_modified = ?4
WHERE repository = ?5 AND key = ?6 AND sha256 IS ?7

-- name: delete_entry
-- Only while the entry still points at ?3 (any blob when ?3 is NULL).
DELETE FROM entries WHERE repository = ?1 AND key = ?2 AND (?3 IS NULL OR sha256 = ?3)

-- name: touch_entries
-- ?1: a JSON array of {"repository", "key", "at"}; last access never moves backwards.
UPDATE entries SET last_access_ms = max(entries.last_access_ms, t.at)
FROM (SELECT value ->> 'repository' AS repository, value ->> 'key' AS key,
             value ->> 'at' AS at FROM json_each(?1)) AS t
WHERE entries.repository = t.repository AND entries.key = t.key

-- name: usage
SELECT count(*) AS entries, coalesce(sum(size), 0) AS bytes FROM entries WHERE repository = ?1

-- name: least_recently_used
SELECT repository, key, kind, sha256, size, content_type, etag, last_modified, digests,
       fetched_at_ms, expires_at_ms, last_access_ms, package, version, upstream_url
FROM entries WHERE repository = ?1 AND kind <> 'negative'
ORDER BY last_access_ms LIMIT ?2

-- name: storage_usage
-- Proxied entries and bytes, hosted bytes, tombstoned bytes (sizes of entries, not of
-- distinct blobs: docs/architecture.md, "Eviction and retention").
SELECT p.entries AS proxied_entries, p.bytes AS proxied_bytes, h.bytes AS hosted_bytes,
       t.bytes AS tombstoned_bytes FROM
    (SELECT count(*) AS entries, coalesce(sum(size), 0) AS bytes
     FROM entries WHERE kind IN ('immutable', 'metadata')) AS p,
    (SELECT coalesce(sum(size), 0) AS bytes FROM entries WHERE kind = 'hosted') AS h,
    (SELECT coalesce(sum(size), 0) AS bytes FROM blob_tombstones) AS t

-- name: evict_lru
-- (?1 bytes to free, ?2 most entries): delete the least recently accessed proxied
-- entries, in order, until ?1 bytes are freed; returns what was deleted. The trigger
-- tombstones their blobs.
DELETE FROM entries WHERE rowid IN (
    SELECT rid FROM (
        SELECT rid, sum(size) OVER (ORDER BY last_access_ms, rid) - size AS freed_before
        FROM (SELECT rowid AS rid, size, last_access_ms FROM entries
              WHERE kind IN ('immutable', 'metadata') ORDER BY last_access_ms LIMIT ?2)
    ) WHERE freed_before < ?1
)
RETURNING repository, key, sha256, size

-- name: expire_unused
-- (?1 repository, ?2 last accessed before ms, ?3 most entries): retention.
DELETE FROM entries WHERE rowid IN (
    SELECT rowid FROM entries
    WHERE repository = ?1 AND last_access_ms < ?2 AND kind IN ('immutable', 'metadata')
    LIMIT ?3
)
RETURNING repository, key, sha256, size

-- name: drop_referenced_tombstones
-- Blobs referenced again (stored anew) are not deleted.
DELETE FROM blob_tombstones
WHERE EXISTS (SELECT 1 FROM entries WHERE entries.sha256 = blob_tombstones.sha256)

-- name: due_tombstones
-- (?1 grace seconds, ?2 after this sha256, ?3 most blobs): tombstones older than the
-- grace period whose blob no entry refers to, in sha256 order from ?2 on (keyset pages).
-- Only read: a tombstone is forgotten (forget_tombstones) once its file is really gone.
SELECT t.sha256, t.size FROM blob_tombstones AS t
WHERE t.sha256 > ?2 AND t.tombstoned_at_ms <= clock_ms() - CAST(?1 * 1000 AS INTEGER)
  AND NOT EXISTS (SELECT 1 FROM entries WHERE entries.sha256 = t.sha256)
ORDER BY t.sha256 LIMIT ?3

-- name: forget_tombstones
-- ?1: a JSON array of sha256s whose files are deleted (or were never there).
DELETE FROM blob_tombstones WHERE sha256 IN (SELECT value FROM json_each(?1))

-- name: unreferenced_blobs
-- ?1: a JSON array of sha256s; those no entry refers to and no tombstone names (the
-- orphan sweep asks once per batch of names, not once per blob).
SELECT v.value AS sha256 FROM json_each(?1) AS v
WHERE NOT EXISTS (SELECT 1 FROM entries WHERE entries.sha256 = v.value)
  AND NOT EXISTS (SELECT 1 FROM blob_tombstones WHERE blob_tombstones.sha256 = v.value)

-- name: created_at
-- When the catalog was made: its first migration (the orphan sweep keeps older blobs).
SELECT min(applied_at_ms) AS at_ms FROM schema_migrations

-- name: delete_expired_negatives
DELETE FROM entries WHERE kind = 'negative' AND expires_at_ms < ?1

-- name: stored_blobs
-- (?1 after this sha256, ?2 most blobs): the blobs entries name, in sha256 order (keyset
-- pages over entries_by_sha256: the scrub's walk).
SELECT sha256, max(size) AS size FROM entries
WHERE sha256 > ?1 GROUP BY sha256 ORDER BY sha256 LIMIT ?2

-- name: stored_blob_totals
-- How many distinct blobs entries name, and their bytes (`proxy verify`'s progress).
SELECT count(*) AS blobs, coalesce(sum(size), 0) AS bytes
FROM (SELECT max(size) AS size FROM entries WHERE sha256 IS NOT NULL GROUP BY sha256) AS b

-- name: blob_entries
-- (?1 sha256, ?2 most rows): the entries naming a blob.
SELECT repository, key FROM entries WHERE sha256 = ?1 ORDER BY repository, key LIMIT ?2

-- name: delete_blob_entries
-- ?1: a blob found corrupt (quarantined); every entry naming it goes, and the trigger
-- tombstones it as for any deletion.
DELETE FROM entries WHERE sha256 = ?1
RETURNING repository, key, sha256, size

-- name: upsert_links
-- ?1: a JSON array of {"repository", "key", "url", "digests" (object), "size"}.
INSERT INTO links (repository, key, url, digests, size, recorded_at_ms)
SELECT value ->> 'repository', value ->> 'key', value ->> 'url',
       coalesce(value ->> 'digests', '{}'), value ->> 'size', ?2
FROM json_each(?1) WHERE true
ON CONFLICT (repository, key) DO UPDATE SET
    url = excluded.url, digests = excluded.digests, size = excluded.size,
    recorded_at_ms = excluded.recorded_at_ms

-- name: select_link
SELECT repository, key, url, digests, size FROM links WHERE repository = ?1 AND key = ?2

-- name: record_first_seen
-- ?1 repository, ?2 a JSON array of keys, ?3 now (Unix ms): a key seen before keeps its time.
INSERT INTO publish_times (repository, key, first_seen_ms)
SELECT ?1, value, ?3 FROM json_each(?2) WHERE true
ON CONFLICT (repository, key) DO NOTHING

-- name: select_first_seen
-- ?1 repository, ?2 a JSON array of keys: one JSON object, key -> first sight (a page of
-- 100,000 files comes back as one text, not 100,000 rows).
SELECT coalesce(json_group_object(key, first_seen_ms), '{}') AS seen FROM publish_times
WHERE repository = ?1 AND key IN (SELECT value FROM json_each(?2))

-- name: select_publish_times
-- ?1 repository, ?2 a JSON array of keys.
SELECT key, first_seen_ms, upstream_ms FROM publish_times
WHERE repository = ?1 AND key IN (SELECT value FROM json_each(?2))

-- name: record_upstream_time
-- ?1 repository, ?2 key, ?3 the upstream's time, ?4 now: the first one learnt is kept.
INSERT INTO publish_times (repository, key, first_seen_ms, upstream_ms)
VALUES (?1, ?2, ?4, ?3)
ON CONFLICT (repository, key) DO UPDATE SET upstream_ms = excluded.upstream_ms
WHERE publish_times.upstream_ms IS NULL

-- name: next_fence
-- SQLite only (Postgres uses a sequence inside claim_lease): run in the claim's write
-- transaction, so the claim below reads the value allocated here. AUTOINCREMENT never
-- reuses a value, even after rows are deleted.
INSERT INTO lease_fences DEFAULT VALUES

-- name: trim_fences
DELETE FROM lease_fences WHERE id < (SELECT max(id) FROM lease_fences)

-- name: claim_lease
-- (?1 key, ?2 holder, ?3 ttl seconds, ?4 repository, ?5 entry key, ?6 now ms, ?7 fence
-- and ?8 renewal stamp of a row watched unrenewed for a TTL, or NULL: see postgres.sql);
-- the fence is the one next_fence just allocated. Refused while the entry (?4, ?5) is stored and
-- fresh at ?6 (?4 given), as in postgres.sql; the write lock makes all of it one step.
INSERT INTO fetch_leases (key, holder, fence, state, acquired_at, renewed_at, expires_at)
SELECT ?1, ?2, (SELECT max(id) FROM lease_fences), 'fetching',
       clock_ms(), clock_ms(), clock_ms() + CAST(?3 * 1000 AS INTEGER)
WHERE NOT EXISTS (
    SELECT 1 FROM entries
    WHERE ?4 IS NOT NULL AND repository = ?4 AND key = ?5
      AND (expires_at_ms IS NULL OR expires_at_ms > ?6)
)
ON CONFLICT (key) DO UPDATE SET
    holder = excluded.holder, fence = excluded.fence, state = 'fetching',
    acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at,
    expires_at = excluded.expires_at,
    stream_file = NULL, stream_type = NULL, stream_length = NULL, written = NULL, waiters = NULL,
    stream_relay = NULL, stream_token = NULL
WHERE fetch_leases.holder = excluded.holder
   OR fetch_leases.state <> 'fetching'
   OR fetch_leases.expires_at <= clock_ms()
   OR (fetch_leases.fence = ?7 AND fetch_leases.renewed_at = ?8)
RETURNING fence

-- name: renew_lease
-- (?1 key, ?2 holder, ?3 fence, ?4 ttl seconds, ?5 bytes written so far, ?6 requests
-- sharing the download): only our own live mandate.
UPDATE fetch_leases SET renewed_at = clock_ms(), expires_at = clock_ms() + CAST(?4 * 1000 AS INTEGER),
                        written = coalesce(?5, written), waiters = coalesce(?6, waiters)
WHERE key = ?1 AND holder = ?2 AND fence = ?3 AND state = 'fetching'

-- name: release_lease
-- (?1 key, ?2 holder, ?3 fence, ?4 final state): expires the row in place, keeps its fence.
UPDATE fetch_leases SET state = ?4, expires_at = max(clock_ms(), acquired_at)
WHERE key = ?1 AND holder = ?2 AND fence = ?3 AND state = 'fetching'

-- name: announce_stream
-- (?1 key, ?2 holder, ?3 fence, ?4 temp file name, ?5 content type, ?6 length,
-- ?7 relay URL, ?8 relay token; a shared volume names the file, object storage the
-- relay): only our
-- own live mandate.
UPDATE fetch_leases SET stream_file = ?4, stream_type = ?5, stream_length = ?6,
    stream_relay = ?7, stream_token = ?8
WHERE key = ?1 AND holder = ?2 AND fence = ?3 AND state = 'fetching'

-- name: select_lease
-- remaining_s: seconds until the lease expires unless renewed (0 once expired).
SELECT key, holder, fence, state, expires_at <= clock_ms() AS expired,
       stream_file, stream_type, stream_length, stream_relay, stream_token,
       max(expires_at - clock_ms(), 0) / 1000.0 AS remaining_s,
       renewed_at AS renewed
FROM fetch_leases WHERE key = ?1

-- name: purge_leases
DELETE FROM fetch_leases WHERE expires_at < clock_ms() - CAST(?1 * 1000 AS INTEGER)

-- name: claim_job_run
-- (?1 name, ?2 interval seconds, ?3 holder), under the job's lock (its flock): a start, if
-- the last one is older than the interval or still 'running' (a pass that died without
-- an outcome; its previous start is kept, for a give-back), as in postgres.sql.
INSERT INTO job_runs (name, run_id, started_at_ms, previous_started_at_ms, holder, outcome)
VALUES (?1, 1, clock_ms(), NULL, ?3, 'running')
ON CONFLICT (name) DO UPDATE SET
    run_id = job_runs.run_id + 1,
    previous_started_at_ms = CASE WHEN job_runs.outcome = 'running'
                                  THEN job_runs.previous_started_at_ms
                                  ELSE job_runs.started_at_ms END,
    started_at_ms = excluded.started_at_ms, holder = excluded.holder, outcome = 'running'
WHERE job_runs.started_at_ms <= clock_ms() - CAST(?2 * 1000 AS INTEGER)
   OR job_runs.outcome = 'running'
RETURNING run_id

-- name: give_back_job_run
UPDATE job_runs SET started_at_ms = coalesce(previous_started_at_ms, 0),
                    outcome = 'cancelled', finished_at_ms = clock_ms()
WHERE name = ?1 AND run_id = ?2

-- name: finish_job_run
-- (?1 name, ?2 run id, ?3 outcome): how the run ended (ok, failed).
UPDATE job_runs SET outcome = ?3, finished_at_ms = clock_ms() WHERE name = ?1 AND run_id = ?2

-- name: select_job_runs
-- Every job's last run; times in Unix ms (NULL: never started), and the database's now.
-- abandoned: NULL, since only the process can tell whether a run's flock is held
-- (SqliteCatalog.job_runs finds out).
SELECT name, run_id, nullif(started_at_ms, 0) AS started_at_ms, finished_at_ms, outcome,
       holder, clock_ms() AS now_ms, NULL AS abandoned
FROM job_runs ORDER BY name

-- name: select_job_cursor
SELECT cursor FROM job_runs WHERE name = ?1

-- name: save_job_cursor
-- (?1 name, ?2 cursor or NULL): where the running pass has got to.
UPDATE job_runs SET cursor = ?2 WHERE name = ?1

-- -- The operators' console and admin API (docs/architecture.md, "Operating: console,
-- -- API and logs"). Keyset pages: each page starts after the last row of the one before.

-- name: browse_entries
-- (?1 repository, ?2 after this key, ?3 most rows): a repository's entries in key order.
SELECT key, kind, size, package, version, fetched_at_ms, last_access_ms
FROM entries WHERE repository = ?1 AND key > ?2 ORDER BY key LIMIT ?3

-- name: search_entries
-- (?1 repository, ?2 package name prefix, ?3 and ?4 after this (package, key), ?5 most
-- rows): the entries of packages whose name starts with ?2, by package then key.
SELECT key, kind, size, package, version, fetched_at_ms, last_access_ms
FROM entries
WHERE repository = ?1 AND package IS NOT NULL
  AND package >= ?2 AND package < ?2 || char(1114111) AND (package, key) > (?3, ?4)
ORDER BY package, key LIMIT ?5

-- name: list_packages
-- (?1 repository, ?2 name prefix or '', ?3 after this package, ?4 most rows): packages
-- with their entries, versions, bytes and last access.
SELECT package, count(*) AS entries, count(DISTINCT version) AS versions,
       coalesce(sum(size), 0) AS bytes, max(last_access_ms) AS last_access_ms
FROM entries
WHERE repository = ?1 AND package IS NOT NULL AND package > ?3
  AND package >= ?2 AND package < ?2 || char(1114111)
GROUP BY package ORDER BY package LIMIT ?4

-- name: package_entries
-- (?1 repository, ?2 package, ?3 most rows): the entries of one package.
SELECT key, kind, size, package, version, fetched_at_ms, last_access_ms
FROM entries WHERE repository = ?1 AND package = ?2 ORDER BY key LIMIT ?3

-- name: delete_package
-- (?1 repository, ?2 package): every entry of the package, negative ones too.
DELETE FROM entries WHERE repository = ?1 AND package = ?2
RETURNING repository, key, sha256, size

-- name: record_purge
INSERT INTO purges (repository, package, key, at_ms) VALUES (?1, ?2, ?3, clock_ms())

-- name: purges_after
SELECT id, repository, package, key FROM purges WHERE id > ?1 ORDER BY id LIMIT 1000

-- name: forget_purges
-- (?1 seconds): purges every replica has long since seen.
DELETE FROM purges WHERE at_ms < clock_ms() - CAST(?1 * 1000 AS INTEGER)

-- name: heartbeat
-- (?1 holder, ?2 host, ?3 pid, ?4 url, ?5 version, ?6 started at ms, ?7 stats JSON): this
-- replica is alive; returns the newest purge id, so one statement also tells it whether
-- to drop what it remembers.
INSERT INTO replicas (holder, host, pid, url, version, started_at_ms, seen_at_ms, stats)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, clock_ms(), ?7)
ON CONFLICT (holder) DO UPDATE SET
    seen_at_ms = excluded.seen_at_ms, stats = excluded.stats, url = excluded.url
RETURNING (SELECT coalesce(max(id), 0) FROM purges) AS newest_purge

-- name: select_replicas
SELECT holder, host, pid, url, version, started_at_ms, seen_at_ms, stats, clock_ms() AS now_ms
FROM replicas ORDER BY started_at_ms

-- name: forget_replicas
-- (?1 seconds): replicas not seen for this long.
DELETE FROM replicas WHERE seen_at_ms < clock_ms() - CAST(?1 * 1000 AS INTEGER)

-- name: in_flight
-- (?1 most rows): downloads under a live lease, oldest first, with their progress.
SELECT key, holder, fence, acquired_at AS acquired_at_ms, renewed_at AS renewed_at_ms, written,
       stream_length, waiters, clock_ms() AS now_ms
FROM fetch_leases WHERE state = 'fetching' AND expires_at > clock_ms()
ORDER BY acquired_at LIMIT ?1

-- name: record_job_failure
-- (?1 name, ?2 run id, ?3 holder, ?4 reason).
INSERT INTO job_failures (name, run_id, holder, at_ms, reason) VALUES (?1, ?2, ?3, clock_ms(), ?4)

-- name: trim_job_failures
-- (?1 rows to keep).
DELETE FROM job_failures WHERE id <= (SELECT max(id) FROM job_failures) - ?1

-- name: select_job_failures
SELECT name, run_id, holder, at_ms, reason FROM job_failures ORDER BY id DESC LIMIT ?1

-- name: create_mirror_run
-- (?1 name, ?2 origin, ?3 holder, ?4 request JSON).
INSERT INTO mirror_runs (name, origin, holder, request, state, started_at_ms, updated_at_ms)
VALUES (?1, ?2, ?3, ?4, 'running', clock_ms(), clock_ms())
RETURNING id

-- name: update_mirror_run
-- (?1 id, ?2 planned, ?3 fetched, ?4 cached, ?5 missing, ?6 failed, ?7 skipped, ?8 bytes):
-- progress; returns whether a cancellation was asked for.
UPDATE mirror_runs SET planned = ?2, fetched = ?3, cached = ?4, missing = ?5, failed = ?6,
                       skipped = ?7, bytes = ?8, updated_at_ms = clock_ms()
WHERE id = ?1
RETURNING cancel_requested

-- name: finish_mirror_run
-- (?1 id, ?2 state, ?3 error, ?4 planned ... ?10 bytes).
UPDATE mirror_runs SET state = ?2, error = ?3, planned = ?4, fetched = ?5, cached = ?6,
                       missing = ?7, failed = ?8, skipped = ?9, bytes = ?10,
                       finished_at_ms = clock_ms(), updated_at_ms = clock_ms()
WHERE id = ?1 AND state = 'running'

-- name: cancel_mirror_run
UPDATE mirror_runs SET cancel_requested = 1 WHERE id = ?1 AND state = 'running'

-- name: select_mirror_run
SELECT id, name, origin, holder, request, state, cancel_requested, planned, fetched, cached,
       missing, failed, skipped, bytes, started_at_ms, updated_at_ms, finished_at_ms, error,
       clock_ms() AS now_ms
FROM mirror_runs WHERE id = ?1

-- name: select_mirror_runs
-- (?1 most rows): the latest runs first.
SELECT id, name, origin, holder, request, state, cancel_requested, planned, fetched, cached,
       missing, failed, skipped, bytes, started_at_ms, updated_at_ms, finished_at_ms, error,
       clock_ms() AS now_ms
FROM mirror_runs ORDER BY id DESC LIMIT ?1

-- name: forget_mirror_runs
-- (?1 seconds): finished runs older than this, and runs nobody finished (their process
-- died) silent as long.
DELETE FROM mirror_runs
WHERE coalesce(finished_at_ms, updated_at_ms) < clock_ms() - CAST(?1 * 1000 AS INTEGER)

-- name: unpackaged_entries
-- (?1 repository, ?2 after this key, ?3 most rows): keys stored without a package (by
-- a version before packages were recorded), in key order.
SELECT key FROM entries
WHERE repository = ?1 AND key > ?2 AND package IS NULL AND kind <> 'hosted'
ORDER BY key LIMIT ?3

-- name: set_packages
-- ?1: a JSON array of {"repository", "key", "package", "version"}.
UPDATE entries SET package = t.package, version = t.version
FROM (SELECT value ->> 'repository' AS repository, value ->> 'key' AS key,
             value ->> 'package' AS package, value ->> 'version' AS version
      FROM json_each(?1)) AS t
WHERE entries.repository = t.repository AND entries.key = t.key AND entries.package IS NULL

-- name: record_backfill
INSERT INTO package_backfills (repository, done_at_ms) VALUES (?1, clock_ms())
ON CONFLICT (repository) DO NOTHING

-- name: select_backfills
SELECT repository FROM package_backfills

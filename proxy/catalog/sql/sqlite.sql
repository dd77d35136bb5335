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

-- name: record_migration
INSERT INTO schema_migrations VALUES (?1, ?2, clock_ms())

-- name: select_entry
SELECT repository, key, kind, sha256, size, content_type, etag, last_modified, digests,
       fetched_at_ms, expires_at_ms, last_access_ms
FROM entries WHERE repository = ?1 AND key = ?2

-- name: upsert_entry
INSERT INTO entries (repository, key, kind, sha256, size, content_type, etag, last_modified,
                     digests, fetched_at_ms, expires_at_ms, last_access_ms)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
ON CONFLICT (repository, key) DO UPDATE SET
    kind = excluded.kind, sha256 = excluded.sha256, size = excluded.size,
    content_type = excluded.content_type, etag = excluded.etag,
    last_modified = excluded.last_modified, digests = excluded.digests,
    fetched_at_ms = excluded.fetched_at_ms, expires_at_ms = excluded.expires_at_ms,
    last_access_ms = max(entries.last_access_ms, excluded.last_access_ms)

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
       fetched_at_ms, expires_at_ms, last_access_ms
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

-- name: delete_expired_negatives
DELETE FROM entries WHERE kind = 'negative' AND expires_at_ms < ?1

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

-- name: next_fence
-- SQLite only (Postgres uses a sequence inside claim_lease): run in the claim's write
-- transaction, so the claim below reads the value allocated here. AUTOINCREMENT never
-- reuses a value, even after rows are deleted.
INSERT INTO lease_fences DEFAULT VALUES

-- name: trim_fences
DELETE FROM lease_fences WHERE id < (SELECT max(id) FROM lease_fences)

-- name: claim_lease
-- (?1 key, ?2 holder, ?3 ttl seconds, ?4 repository, ?5 entry key, ?6 now ms); the fence
-- is the one next_fence just allocated. Refused while the entry (?4, ?5) is stored and
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
    stream_file = NULL, stream_type = NULL, stream_length = NULL
WHERE fetch_leases.holder = excluded.holder
   OR fetch_leases.state <> 'fetching'
   OR fetch_leases.expires_at <= clock_ms()
RETURNING fence

-- name: renew_lease
-- (?1 key, ?2 holder, ?3 fence, ?4 ttl seconds): only our own live mandate.
UPDATE fetch_leases SET renewed_at = clock_ms(), expires_at = clock_ms() + CAST(?4 * 1000 AS INTEGER)
WHERE key = ?1 AND holder = ?2 AND fence = ?3 AND state = 'fetching'

-- name: release_lease
-- (?1 key, ?2 holder, ?3 fence, ?4 final state): expires the row in place, keeps its fence.
UPDATE fetch_leases SET state = ?4, expires_at = max(clock_ms(), acquired_at)
WHERE key = ?1 AND holder = ?2 AND fence = ?3 AND state = 'fetching'

-- name: announce_stream
-- (?1 key, ?2 holder, ?3 fence, ?4 temp file name, ?5 content type, ?6 length): only our
-- own live mandate.
UPDATE fetch_leases SET stream_file = ?4, stream_type = ?5, stream_length = ?6
WHERE key = ?1 AND holder = ?2 AND fence = ?3 AND state = 'fetching'

-- name: select_lease
-- remaining_s: seconds until the lease expires unless renewed (0 once expired).
SELECT key, holder, fence, state, expires_at <= clock_ms() AS expired,
       stream_file, stream_type, stream_length,
       max(expires_at - clock_ms(), 0) / 1000.0 AS remaining_s
FROM fetch_leases WHERE key = ?1

-- name: purge_leases
DELETE FROM fetch_leases WHERE expires_at < clock_ms() - CAST(?1 * 1000 AS INTEGER)

-- name: claim_job_run
-- (?1 name, ?2 interval seconds, ?3 holder): a start, if the last one is older than the interval.
INSERT INTO job_runs (name, run_id, started_at_ms, previous_started_at_ms, holder, outcome)
VALUES (?1, 1, clock_ms(), NULL, ?3, 'running')
ON CONFLICT (name) DO UPDATE SET
    run_id = job_runs.run_id + 1, previous_started_at_ms = job_runs.started_at_ms,
    started_at_ms = excluded.started_at_ms, holder = excluded.holder, outcome = 'running'
WHERE job_runs.started_at_ms <= clock_ms() - CAST(?2 * 1000 AS INTEGER)
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
SELECT name, run_id, nullif(started_at_ms, 0) AS started_at_ms, finished_at_ms, outcome,
       holder, clock_ms() AS now_ms
FROM job_runs ORDER BY name

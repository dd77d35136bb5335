-- Named statements of the Postgres catalog (loaded by proxy/catalog/queries.py).
-- Each "-- name: x" starts a statement; the same name in sqlite.sql has the same meaning
-- and the same numbered parameters. Lease and job times use clock_timestamp(): the
-- database's clock, read at the statement (now() would be the transaction's start).

-- name: ping
SELECT 1

-- name: select_clock
-- The database's clock, Unix ms.
SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms

-- name: lock_migrations
-- Postgres only: replicas starting together apply the schema one after another; the lock
-- is released by the commit (SQLite gets the same from BEGIN EXCLUSIVE).
SELECT pg_advisory_xact_lock(482181741689)

-- name: create_schema_migrations
CREATE TABLE IF NOT EXISTS schema_migrations
    (version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL)

-- name: applied_migrations
SELECT version FROM schema_migrations

-- name: migrations_table
-- 1 if the database has a catalog's schema_migrations table (read without creating it).
SELECT (to_regclass('schema_migrations') IS NOT NULL)::int AS present

-- name: record_migration
INSERT INTO schema_migrations VALUES ($1, $2, clock_timestamp())

-- name: select_entry
SELECT repository, key, kind, sha256, size, content_type, etag, last_modified, digests::text,
       fetched_at_ms, expires_at_ms, last_access_ms, package, version, upstream_url
FROM entries WHERE repository = $1 AND key = $2

-- name: upsert_entry
INSERT INTO entries (repository, key, kind, sha256, size, content_type, etag, last_modified,
                     digests, fetched_at_ms, expires_at_ms, last_access_ms, package, version,
                     upstream_url)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, $11, $12, $13, $14,
        $15)
ON CONFLICT (repository, key) DO UPDATE SET
    kind = EXCLUDED.kind, sha256 = EXCLUDED.sha256, size = EXCLUDED.size,
    content_type = EXCLUDED.content_type, etag = EXCLUDED.etag,
    last_modified = EXCLUDED.last_modified, digests = EXCLUDED.digests,
    fetched_at_ms = EXCLUDED.fetched_at_ms, expires_at_ms = EXCLUDED.expires_at_ms,
    last_access_ms = greatest(entries.last_access_ms, EXCLUDED.last_access_ms),
    package = coalesce(EXCLUDED.package, entries.package),
    version = coalesce(EXCLUDED.version, entries.version),
    upstream_url = coalesce(EXCLUDED.upstream_url, entries.upstream_url)

-- name: refresh_entry
UPDATE entries SET fetched_at_ms = $1, expires_at_ms = $2, etag = $3, last_modified = $4
WHERE repository = $5 AND key = $6 AND sha256 IS NOT DISTINCT FROM $7

-- name: delete_entry
-- Only while the entry still points at $3 (any blob when $3 is NULL).
DELETE FROM entries WHERE repository = $1 AND key = $2 AND ($3::text IS NULL OR sha256 = $3)

-- name: touch_entries
-- $1: a JSON array of {"repository", "key", "at"}; last access never moves backwards.
UPDATE entries AS e SET last_access_ms = greatest(e.last_access_ms, t.at)
FROM jsonb_to_recordset($1::jsonb) AS t(repository text, key text, at bigint)
WHERE e.repository = t.repository AND e.key = t.key

-- name: usage
SELECT count(*) AS entries, coalesce(sum(size), 0) AS bytes FROM entries WHERE repository = $1

-- name: least_recently_used
SELECT repository, key, kind, sha256, size, content_type, etag, last_modified, digests::text,
       fetched_at_ms, expires_at_ms, last_access_ms, package, version, upstream_url
FROM entries WHERE repository = $1 AND kind <> 'negative'
ORDER BY last_access_ms LIMIT $2

-- name: storage_usage
-- Proxied entries and bytes, hosted bytes, tombstoned bytes (sizes of entries, not of
-- distinct blobs: docs/architecture.md, "Eviction and retention").
SELECT p.entries AS proxied_entries, p.bytes AS proxied_bytes, h.bytes AS hosted_bytes,
       t.bytes AS tombstoned_bytes FROM
    (SELECT count(*) AS entries, coalesce(sum(size), 0)::bigint AS bytes
     FROM entries WHERE kind IN ('immutable', 'metadata')) AS p,
    (SELECT coalesce(sum(size), 0)::bigint AS bytes FROM entries WHERE kind = 'hosted') AS h,
    (SELECT coalesce(sum(size), 0)::bigint AS bytes FROM blob_tombstones) AS t

-- name: evict_lru
-- ($1 bytes to free, $2 most entries): delete the least recently accessed proxied
-- entries, in order, until $1 bytes are freed; returns what was deleted. Rows another
-- transaction holds (an access flush touching them) are skipped, never waited for: a
-- pass and a flush locking rows in different orders would deadlock. The trigger
-- tombstones their blobs.
WITH candidates AS (
    SELECT repository, key, size, last_access_ms FROM entries
    WHERE kind IN ('immutable', 'metadata') ORDER BY last_access_ms LIMIT $2
    FOR UPDATE SKIP LOCKED
), victims AS (
    SELECT repository, key, last_access_ms,
           sum(size) OVER (ORDER BY last_access_ms, repository, key) - size AS freed_before
    FROM candidates
)
DELETE FROM entries AS e USING victims AS v
WHERE e.repository = v.repository AND e.key = v.key
  AND e.last_access_ms = v.last_access_ms AND v.freed_before < $1::bigint
RETURNING e.repository, e.key, e.sha256, e.size

-- name: expire_unused
-- ($1 repository, $2 last accessed before ms, $3 most entries): retention.
DELETE FROM entries AS e USING (
    SELECT repository, key FROM entries
    WHERE repository = $1 AND last_access_ms < $2 AND kind IN ('immutable', 'metadata')
    LIMIT $3
    FOR UPDATE SKIP LOCKED  -- as in evict_lru: never wait on a flush's row locks
) AS v
WHERE e.repository = v.repository AND e.key = v.key AND e.last_access_ms < $2
RETURNING e.repository, e.key, e.sha256, e.size

-- name: drop_referenced_tombstones
-- Blobs referenced again (stored anew) are not deleted.
DELETE FROM blob_tombstones AS t
WHERE EXISTS (SELECT 1 FROM entries WHERE entries.sha256 = t.sha256)

-- name: due_tombstones
-- ($1 grace seconds, $2 after this sha256, $3 most blobs): tombstones older than the
-- grace period whose blob no entry refers to, in sha256 order from $2 on (keyset pages).
-- Only read: a tombstone is forgotten (forget_tombstones) once its file is really gone.
SELECT t.sha256, t.size FROM blob_tombstones AS t
WHERE t.sha256 > $2 AND t.tombstoned_at <= clock_timestamp() - make_interval(secs => $1)
  AND NOT EXISTS (SELECT 1 FROM entries WHERE entries.sha256 = t.sha256)
ORDER BY t.sha256 LIMIT $3

-- name: forget_tombstones
-- $1: a JSON array of sha256s whose files are deleted (or were never there).
DELETE FROM blob_tombstones WHERE sha256 IN (SELECT jsonb_array_elements_text($1::jsonb))

-- name: unreferenced_blobs
-- $1: a JSON array of sha256s; those no entry refers to and no tombstone names (the
-- orphan sweep asks once per batch of names, not once per blob).
SELECT v.sha AS sha256 FROM jsonb_array_elements_text($1::jsonb) AS v(sha)
WHERE NOT EXISTS (SELECT 1 FROM entries WHERE entries.sha256 = v.sha)
  AND NOT EXISTS (SELECT 1 FROM blob_tombstones WHERE blob_tombstones.sha256 = v.sha)

-- name: created_at
-- When the catalog was made: its first migration (the orphan sweep keeps older blobs).
SELECT (extract(epoch FROM min(applied_at)) * 1000)::bigint AS at_ms FROM schema_migrations

-- name: delete_expired_negatives
DELETE FROM entries WHERE kind = 'negative' AND expires_at_ms < $1

-- name: stored_blobs
-- ($1 after this sha256, $2 most blobs): the blobs entries name, in sha256 order (keyset
-- pages over entries_by_sha256: the scrub's walk).
SELECT sha256, max(size) AS size FROM entries
WHERE sha256 > $1 GROUP BY sha256 ORDER BY sha256 LIMIT $2

-- name: stored_blob_totals
-- How many distinct blobs entries name, and their bytes (`proxy verify`'s progress).
SELECT count(*) AS blobs, coalesce(sum(size), 0) AS bytes
FROM (SELECT max(size) AS size FROM entries WHERE sha256 IS NOT NULL GROUP BY sha256) AS b

-- name: blob_entries
-- ($1 sha256, $2 most rows): the entries naming a blob, in byte order (as SQLite's).
SELECT repository, key FROM entries WHERE sha256 = $1
ORDER BY repository COLLATE "C", key COLLATE "C" LIMIT $2

-- name: delete_blob_entries
-- $1: a blob found corrupt (quarantined); every entry naming it goes, and the trigger
-- tombstones it as for any deletion.
DELETE FROM entries WHERE sha256 = $1
RETURNING repository, key, sha256, size

-- name: upsert_links
-- $1: a JSON array of {"repository", "key", "url", "digests" (object), "size"}.
INSERT INTO links (repository, key, url, digests, size, recorded_at_ms)
SELECT t.repository, t.key, t.url, coalesce(t.digests, '{}'), t.size, $2
FROM jsonb_to_recordset($1::jsonb) AS t(repository text, key text, url text, digests jsonb, size bigint)
ON CONFLICT (repository, key) DO UPDATE SET
    url = EXCLUDED.url, digests = EXCLUDED.digests, size = EXCLUDED.size,
    recorded_at_ms = EXCLUDED.recorded_at_ms

-- name: select_link
SELECT repository, key, url, digests::text, size FROM links WHERE repository = $1 AND key = $2

-- name: record_first_seen
-- $1 repository, $2 a JSON array of keys, $3 now (Unix ms): a key seen before keeps its time.
INSERT INTO publish_times (repository, key, first_seen_ms)
SELECT $1, k, $3 FROM jsonb_array_elements_text($2::jsonb) AS v(k)
ON CONFLICT (repository, key) DO NOTHING

-- name: select_first_seen
-- $1 repository, $2 a JSON array of keys: one JSON object, key -> first sight (a page of
-- 100,000 files comes back as one text, not 100,000 rows).
SELECT coalesce(jsonb_object_agg(key, first_seen_ms), '{}'::jsonb)::text AS seen
FROM publish_times
WHERE repository = $1 AND key IN (SELECT jsonb_array_elements_text($2::jsonb))

-- name: select_publish_times
-- $1 repository, $2 a JSON array of keys.
SELECT key, first_seen_ms, upstream_ms FROM publish_times
WHERE repository = $1 AND key IN (SELECT jsonb_array_elements_text($2::jsonb))

-- name: record_upstream_time
-- $1 repository, $2 key, $3 the upstream's time, $4 now: the first one learnt is kept.
INSERT INTO publish_times AS p (repository, key, first_seen_ms, upstream_ms)
VALUES ($1, $2, $4, $3)
ON CONFLICT (repository, key) DO UPDATE SET upstream_ms = EXCLUDED.upstream_ms
WHERE p.upstream_ms IS NULL

-- name: claim_lease
-- ($1 key, $2 holder, $3 ttl seconds, $4 repository, $5 entry key, $6 now ms, $7 fence
-- and $8 renewal stamp of a row the claimant watched go unrenewed for a whole TTL by its
-- own monotonic clock, or NULL). Wins if the row is absent, expired, not 'fetching',
-- ours, or still exactly the row watched (a clock that stepped back keeps a dead
-- holder's lease "live" for as long as it stepped), unless ($4 given) the entry ($4, $5)
-- is stored and fresh at $6: a claim that comes after the holder stored it gets nothing,
-- and the waiter finds the entry. A claim that loses writes nothing (no row lock, no
-- transaction ID): the UPDATE matches no row, and the INSERT is not tried while a row
-- exists (ON CONFLICT covers the race of two first claims). All of it reads one
-- snapshot, so a release seen is preceded by the entry it stored. The fence comes from
-- a sequence: it grows on every claim and stays monotonic after purges.
WITH fresh AS (
    SELECT EXISTS (
        SELECT 1 FROM entries
        WHERE $4::text IS NOT NULL AND repository = $4 AND key = $5
          AND (expires_at_ms IS NULL OR expires_at_ms > $6::bigint)
    ) AS stored
), taken AS (
    UPDATE fetch_leases AS l
    SET holder = $2, fence = nextval('fetch_lease_fence'), state = 'fetching',
        acquired_at = clock_timestamp(), renewed_at = clock_timestamp(),
        expires_at = clock_timestamp() + make_interval(secs => $3),
        stream_file = NULL, stream_type = NULL, stream_length = NULL, written = NULL, waiters = NULL,
        stream_relay = NULL, stream_token = NULL
    FROM fresh
    WHERE l.key = $1 AND NOT fresh.stored
      AND (l.holder = $2 OR l.state <> 'fetching' OR l.expires_at <= clock_timestamp()
           OR (l.fence = $7::bigint AND extract(epoch FROM l.renewed_at)::float8 = $8::float8))
    RETURNING l.fence
), inserted AS (
    INSERT INTO fetch_leases (key, holder, fence, state, acquired_at, renewed_at, expires_at)
    SELECT $1, $2, nextval('fetch_lease_fence'), 'fetching',
           clock_timestamp(), clock_timestamp(), clock_timestamp() + make_interval(secs => $3)
    FROM fresh
    WHERE NOT fresh.stored AND NOT EXISTS (SELECT 1 FROM fetch_leases WHERE key = $1)
    ON CONFLICT (key) DO NOTHING
    RETURNING fence
)
SELECT fence FROM taken UNION ALL SELECT fence FROM inserted

-- name: renew_lease
-- ($1 key, $2 holder, $3 fence, $4 ttl seconds, $5 bytes written so far, $6 requests
-- sharing the download): only our own live mandate.
UPDATE fetch_leases
SET renewed_at = clock_timestamp(), expires_at = clock_timestamp() + make_interval(secs => $4),
    written = coalesce($5::bigint, written), waiters = coalesce($6::integer, waiters)
WHERE key = $1 AND holder = $2 AND fence = $3 AND state = 'fetching'

-- name: release_lease
-- ($1 key, $2 holder, $3 fence, $4 final state): expires the row in place, keeps its fence.
UPDATE fetch_leases SET state = $4, expires_at = greatest(clock_timestamp(), acquired_at)
WHERE key = $1 AND holder = $2 AND fence = $3 AND state = 'fetching'

-- name: announce_stream
-- ($1 key, $2 holder, $3 fence, $4 temp file name, $5 content type, $6 length,
-- $7 relay URL, $8 relay token; a shared volume names the file, object storage the
-- relay): only our
-- own live mandate; the trigger wakes the waiters.
UPDATE fetch_leases SET stream_file = $4, stream_type = $5, stream_length = $6,
    stream_relay = $7, stream_token = $8
WHERE key = $1 AND holder = $2 AND fence = $3 AND state = 'fetching'

-- name: select_lease
-- remaining_s: seconds until the lease expires unless renewed (0 once expired);
-- renewed: the stamp of its last claim or renewal, compared only for equality.
SELECT key, holder, fence, state, expires_at <= clock_timestamp() AS expired,
       stream_file, stream_type, stream_length, stream_relay, stream_token,
       greatest(extract(epoch FROM expires_at - clock_timestamp()), 0)::float8 AS remaining_s,
       extract(epoch FROM renewed_at)::float8 AS renewed
FROM fetch_leases WHERE key = $1

-- name: purge_leases
DELETE FROM fetch_leases WHERE expires_at < clock_timestamp() - make_interval(secs => $1)

-- name: try_job_lock
-- Postgres only: a session lock on the session connection, held for the pass; it dies
-- with the connection if the process dies (SQLite gets the same from an flock on a
-- file). select_job_runs looks for the same key in pg_locks.
SELECT pg_try_advisory_lock(hashtext('proxy-job:' || $1))

-- name: unlock_job
SELECT pg_advisory_unlock(hashtext('proxy-job:' || $1))

-- name: claim_job_run
-- ($1 name, $2 interval seconds, $3 holder), under the job's lock (try_job_lock): a start,
-- if the last one is older than the interval or still 'running' (under the lock, a run
-- still 'running' is one whose pass died without an outcome: its lock went with it; its
-- previous start is kept, for a give-back). A claim that is not due writes nothing (no
-- row lock), like claim_lease.
WITH taken AS (
    UPDATE job_runs
    SET run_id = run_id + 1,
        previous_started_at = CASE WHEN outcome = 'running' THEN previous_started_at
                                   ELSE started_at END,
        started_at = clock_timestamp(), holder = $3, outcome = 'running'
    WHERE name = $1
      AND (started_at <= clock_timestamp() - make_interval(secs => $2) OR outcome = 'running')
    RETURNING run_id
), inserted AS (
    INSERT INTO job_runs (name, run_id, started_at, previous_started_at, holder, outcome)
    SELECT $1, 1, clock_timestamp(), NULL, $3, 'running'
    WHERE NOT EXISTS (SELECT 1 FROM job_runs WHERE name = $1)
    ON CONFLICT (name) DO NOTHING
    RETURNING run_id
)
SELECT run_id FROM taken UNION ALL SELECT run_id FROM inserted

-- name: give_back_job_run
UPDATE job_runs SET started_at = coalesce(previous_started_at, '-infinity'),
                    outcome = 'cancelled', finished_at = clock_timestamp()
WHERE name = $1 AND run_id = $2

-- name: finish_job_run
-- ($1 name, $2 run id, $3 outcome): how the run ended (ok, failed).
UPDATE job_runs SET outcome = $3, finished_at = clock_timestamp() WHERE name = $1 AND run_id = $2

-- name: select_job_runs
-- Every job's last run; times in Unix ms (NULL: never started), and the database's now.
SELECT name, run_id,
       CASE WHEN isfinite(started_at) THEN (extract(epoch FROM started_at) * 1000)::bigint END
           AS started_at_ms,
       (extract(epoch FROM finished_at) * 1000)::bigint AS finished_at_ms, outcome, holder,
       (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms,
       -- A run still 'running' whose job lock nobody holds: its pass died with its
       -- process or its connection. The key is try_job_lock's, as pg_locks shows a
       -- one-bigint advisory lock (high half in classid, low half in objid).
       CASE WHEN outcome = 'running' THEN NOT EXISTS (
           SELECT 1 FROM pg_locks AS l
           WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
             AND ((l.classid::bigint << 32) | l.objid::bigint)
                 = hashtext('proxy-job:' || job_runs.name)::bigint
       ) ELSE false END AS abandoned
FROM job_runs ORDER BY name

-- name: select_job_cursor
SELECT cursor FROM job_runs WHERE name = $1

-- name: save_job_cursor
-- ($1 name, $2 cursor or NULL): where the running pass has got to.
UPDATE job_runs SET cursor = $2 WHERE name = $1

-- -- The operators' console and admin API (docs/architecture.md, "Operating: console,
-- -- API and logs"). Keyset pages: each page starts after the last row of the one before.
-- -- Package names compare in byte order (COLLATE "C", as the index): prefix ranges and
-- -- page order agree with SQLite's.

-- name: browse_entries
-- ($1 repository, $2 after this key, $3 most rows): a repository's entries in key order.
SELECT key, kind, size, package, version, fetched_at_ms, last_access_ms
FROM entries WHERE repository = $1 AND key > $2 ORDER BY key LIMIT $3

-- name: search_entries
-- ($1 repository, $2 package name prefix, $3 and $4 after this (package, key), $5 most
-- rows): the entries of packages whose name starts with $2, by package then key.
SELECT key, kind, size, package, version, fetched_at_ms, last_access_ms
FROM entries
WHERE repository = $1 AND package IS NOT NULL
  AND package COLLATE "C" >= $2 AND package COLLATE "C" < $2 || chr(1114111)
  AND (package COLLATE "C", key COLLATE "C") > ($3, $4)
ORDER BY package COLLATE "C", key COLLATE "C" LIMIT $5

-- name: list_packages
-- ($1 repository, $2 name prefix or '', $3 after this package, $4 most rows): packages
-- with their entries, versions, bytes and last access.
SELECT package COLLATE "C" AS package, count(*) AS entries, count(DISTINCT version) AS versions,
       coalesce(sum(size), 0) AS bytes, max(last_access_ms) AS last_access_ms
FROM entries
WHERE repository = $1 AND package IS NOT NULL AND package COLLATE "C" > $3
  AND package COLLATE "C" >= $2 AND package COLLATE "C" < $2 || chr(1114111)
GROUP BY package COLLATE "C" ORDER BY package COLLATE "C" LIMIT $4

-- name: package_entries
-- ($1 repository, $2 package, $3 most rows): the entries of one package.
SELECT key, kind, size, package, version, fetched_at_ms, last_access_ms
FROM entries WHERE repository = $1 AND package COLLATE "C" = $2 AND package IS NOT NULL
ORDER BY key COLLATE "C" LIMIT $3

-- name: delete_package
-- ($1 repository, $2 package): every entry of the package, negative ones too.
DELETE FROM entries WHERE repository = $1 AND package COLLATE "C" = $2 AND package IS NOT NULL
RETURNING repository, key, sha256, size

-- name: record_purge
INSERT INTO purges (repository, package, key, at_ms) VALUES ($1, $2, $3, clock_ms())

-- name: purges_after
SELECT id, repository, package, key FROM purges WHERE id > $1 ORDER BY id LIMIT 1000

-- name: forget_purges
-- ($1 seconds): purges every replica has long since seen.
DELETE FROM purges WHERE at_ms < clock_ms() - ($1 * 1000)::bigint

-- name: heartbeat
-- ($1 holder, $2 host, $3 pid, $4 url, $5 version, $6 started at ms, $7 stats JSON): this
-- replica is alive; returns the newest purge id, so one statement also tells it whether
-- to drop what it remembers.
INSERT INTO replicas (holder, host, pid, url, version, started_at_ms, seen_at_ms, stats)
VALUES ($1, $2, $3, $4, $5, $6, clock_ms(), $7::jsonb)
ON CONFLICT (holder) DO UPDATE SET
    seen_at_ms = EXCLUDED.seen_at_ms, stats = EXCLUDED.stats, url = EXCLUDED.url
RETURNING (SELECT coalesce(max(id), 0) FROM purges) AS newest_purge

-- name: select_replicas
SELECT holder, host, pid, url, version, started_at_ms, seen_at_ms, stats::text AS stats,
       clock_ms() AS now_ms
FROM replicas ORDER BY started_at_ms

-- name: forget_replicas
-- ($1 seconds): replicas not seen for this long.
DELETE FROM replicas WHERE seen_at_ms < clock_ms() - ($1 * 1000)::bigint

-- name: in_flight
-- ($1 most rows): downloads under a live lease, oldest first, with their progress.
SELECT key, holder, fence, (extract(epoch FROM acquired_at) * 1000)::bigint AS acquired_at_ms,
       (extract(epoch FROM renewed_at) * 1000)::bigint AS renewed_at_ms, written, stream_length,
       waiters, clock_ms() AS now_ms
FROM fetch_leases WHERE state = 'fetching' AND expires_at > clock_timestamp()
ORDER BY acquired_at LIMIT $1

-- name: record_job_failure
-- ($1 name, $2 run id, $3 holder, $4 reason).
INSERT INTO job_failures (name, run_id, holder, at_ms, reason) VALUES ($1, $2, $3, clock_ms(), $4)

-- name: trim_job_failures
-- ($1 rows to keep).
DELETE FROM job_failures WHERE id <= (SELECT max(id) FROM job_failures) - $1

-- name: select_job_failures
SELECT name, run_id, holder, at_ms, reason FROM job_failures ORDER BY id DESC LIMIT $1

-- name: create_mirror_run
-- ($1 name, $2 origin, $3 holder, $4 request JSON).
INSERT INTO mirror_runs (name, origin, holder, request, state, started_at_ms, updated_at_ms)
VALUES ($1, $2, $3, $4::jsonb, 'running', clock_ms(), clock_ms())
RETURNING id

-- name: update_mirror_run
-- ($1 id, $2 planned, $3 fetched, $4 cached, $5 missing, $6 failed, $7 skipped, $8 bytes):
-- progress; returns whether a cancellation was asked for.
UPDATE mirror_runs SET planned = $2, fetched = $3, cached = $4, missing = $5, failed = $6,
                       skipped = $7, bytes = $8, updated_at_ms = clock_ms()
WHERE id = $1
RETURNING cancel_requested

-- name: finish_mirror_run
-- ($1 id, $2 state, $3 error, $4 planned ... $10 bytes).
UPDATE mirror_runs SET state = $2, error = $3, planned = $4, fetched = $5, cached = $6,
                       missing = $7, failed = $8, skipped = $9, bytes = $10,
                       finished_at_ms = clock_ms(), updated_at_ms = clock_ms()
WHERE id = $1 AND state = 'running'

-- name: cancel_mirror_run
UPDATE mirror_runs SET cancel_requested = true WHERE id = $1 AND state = 'running'

-- name: select_mirror_run
SELECT id, name, origin, holder, request::text AS request, state, cancel_requested, planned,
       fetched, cached, missing, failed, skipped, bytes, started_at_ms, updated_at_ms,
       finished_at_ms, error, clock_ms() AS now_ms
FROM mirror_runs WHERE id = $1

-- name: select_mirror_runs
-- ($1 most rows): the latest runs first.
SELECT id, name, origin, holder, request::text AS request, state, cancel_requested, planned,
       fetched, cached, missing, failed, skipped, bytes, started_at_ms, updated_at_ms,
       finished_at_ms, error, clock_ms() AS now_ms
FROM mirror_runs ORDER BY id DESC LIMIT $1

-- name: forget_mirror_runs
-- ($1 seconds): finished runs older than this, and runs nobody finished (their process
-- died) silent as long.
DELETE FROM mirror_runs
WHERE coalesce(finished_at_ms, updated_at_ms) < clock_ms() - ($1 * 1000)::bigint

-- name: unpackaged_entries
-- ($1 repository, $2 after this key, $3 most rows): keys stored without a package (by
-- a version before packages were recorded), in key order.
SELECT key FROM entries
WHERE repository = $1 AND key > $2 AND package IS NULL AND kind <> 'hosted'
ORDER BY key LIMIT $3

-- name: set_packages
-- $1: a JSON array of {"repository", "key", "package", "version"}.
UPDATE entries AS e SET package = t.package, version = t.version
FROM jsonb_to_recordset($1::jsonb) AS t(repository text, key text, package text, version text)
WHERE e.repository = t.repository AND e.key = t.key AND e.package IS NULL

-- name: record_backfill
INSERT INTO package_backfills (repository, done_at_ms) VALUES ($1, clock_ms())
ON CONFLICT (repository) DO NOTHING

-- name: select_backfills
SELECT repository FROM package_backfills

-- Eviction and retention (docs/architecture.md, "Eviction and retention").

-- The eviction pass walks proxied entries by last access across every repository; the
-- index carries the size so the pass's running total and its victims come from the
-- index alone. Retention uses entries_by_last_access (repository, last_access_ms).
CREATE INDEX entries_evictable_by_access ON entries (last_access_ms) INCLUDE (size)
    WHERE kind IN ('immutable', 'metadata');
CREATE INDEX entries_hosted_size ON entries (size) WHERE kind = 'hosted';

-- A blob that lost an entry's reference waits here for the grace period before its
-- file is deleted, so a client still reading it on any replica finishes first. The
-- tombstone is only a candidate: the file goes only if no entry refers to it then.
CREATE TABLE blob_tombstones (
    sha256         text        PRIMARY KEY,
    size           bigint      NOT NULL,
    tombstoned_at  timestamptz NOT NULL
);
CREATE INDEX blob_tombstones_by_time ON blob_tombstones (tombstoned_at);

-- Every path that drops a reference (eviction, retention, sweeps, a replaced upload or
-- refreshed page) tombstones the blob in the same transaction.
CREATE FUNCTION entries_tombstone_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO blob_tombstones (sha256, size, tombstoned_at)
    SELECT DISTINCT ON (sha256) sha256, size, clock_timestamp()
    FROM gone WHERE sha256 IS NOT NULL
    ORDER BY sha256  -- one lock order for every deleting statement: no deadlock
    ON CONFLICT (sha256) DO UPDATE SET tombstoned_at = EXCLUDED.tombstoned_at;
    RETURN NULL;
END
$$;
CREATE TRIGGER entries_tombstone_delete AFTER DELETE ON entries
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION entries_tombstone_deleted();

CREATE FUNCTION entries_tombstone_replaced() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO blob_tombstones (sha256, size, tombstoned_at)
    VALUES (OLD.sha256, OLD.size, clock_timestamp())
    ON CONFLICT (sha256) DO UPDATE SET tombstoned_at = EXCLUDED.tombstoned_at;
    RETURN NULL;
END
$$;
CREATE TRIGGER entries_tombstone_update AFTER UPDATE OF sha256 ON entries
    FOR EACH ROW
    WHEN (OLD.sha256 IS NOT NULL AND OLD.sha256 IS DISTINCT FROM NEW.sha256)
    EXECUTE FUNCTION entries_tombstone_replaced();

-- Schedules: how each job's last run ended, for `proxy jobs`.
ALTER TABLE job_runs ADD COLUMN finished_at timestamptz;
ALTER TABLE job_runs ADD COLUMN outcome text;

-- Eviction and retention (docs/architecture.md, "Eviction and retention").

-- The eviction pass walks proxied entries by last access across every repository; the
-- index carries the size so the pass's running total and its victims come from the
-- index alone. Retention uses entries_by_last_access (repository, last_access_ms).
CREATE INDEX entries_evictable_by_access ON entries (last_access_ms, size)
    WHERE kind IN ('immutable', 'metadata');
CREATE INDEX entries_hosted_size ON entries (size) WHERE kind = 'hosted';

-- A blob that lost an entry's reference waits here for the grace period before its
-- file is deleted, so a client still reading it finishes first. The tombstone is only
-- a candidate: the file goes only if no entry refers to it then.
CREATE TABLE blob_tombstones (
    sha256            TEXT    PRIMARY KEY,
    size              INTEGER NOT NULL,
    tombstoned_at_ms  INTEGER NOT NULL
);
CREATE INDEX blob_tombstones_by_time ON blob_tombstones (tombstoned_at_ms);

-- Every path that drops a reference (eviction, retention, sweeps, a replaced upload or
-- refreshed page) tombstones the blob in the same transaction. clock_ms() is the
-- catalog's clock, which every connection of the proxy registers.
CREATE TRIGGER entries_tombstone_delete AFTER DELETE ON entries
    WHEN old.sha256 IS NOT NULL
BEGIN
    INSERT INTO blob_tombstones (sha256, size, tombstoned_at_ms)
    VALUES (old.sha256, old.size, clock_ms())
    ON CONFLICT (sha256) DO UPDATE SET tombstoned_at_ms = excluded.tombstoned_at_ms;
END;

CREATE TRIGGER entries_tombstone_update AFTER UPDATE OF sha256 ON entries
    WHEN old.sha256 IS NOT NULL AND old.sha256 IS NOT new.sha256
BEGIN
    INSERT INTO blob_tombstones (sha256, size, tombstoned_at_ms)
    VALUES (old.sha256, old.size, clock_ms())
    ON CONFLICT (sha256) DO UPDATE SET tombstoned_at_ms = excluded.tombstoned_at_ms;
END;

-- Schedules: how each job's last run ended, for `proxy jobs`.
ALTER TABLE job_runs ADD COLUMN finished_at_ms INTEGER;
ALTER TABLE job_runs ADD COLUMN outcome TEXT;

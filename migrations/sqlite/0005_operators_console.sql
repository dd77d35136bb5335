-- The operators' console and admin API (docs/architecture.md, "Operating: console, API
-- and logs").

-- Which package and version an entry belongs to (the format says, when it is stored),
-- and the upstream URL its body came from. The index serves browsing and searching a
-- repository by package name, and purging a package, on a catalog of millions.
ALTER TABLE entries ADD COLUMN package TEXT;
ALTER TABLE entries ADD COLUMN version TEXT;
ALTER TABLE entries ADD COLUMN upstream_url TEXT;
CREATE INDEX entries_by_package ON entries (repository, package, key) WHERE package IS NOT NULL;

-- Repositories whose entries stored before the package column existed have all been
-- given their package (the "packages" job does it once per repository).
CREATE TABLE package_backfills (repository TEXT PRIMARY KEY, done_at_ms INTEGER NOT NULL);

-- Progress of a download, written by the holder with each renewal (no extra statement):
-- bytes on disk so far and how many requests share it.
ALTER TABLE fetch_leases ADD COLUMN written INTEGER;
ALTER TABLE fetch_leases ADD COLUMN waiters INTEGER;

-- One row per replica (lease holder), written by its heartbeat: when it started and
-- was last seen, its address and version, and its counters since it started (hits and
-- misses per repository, upstream health per host) as JSON. Fleet-wide numbers are the
-- sums over these rows.
CREATE TABLE replicas (
    holder        TEXT    PRIMARY KEY,
    host          TEXT    NOT NULL,
    pid           INTEGER NOT NULL,
    url           TEXT    NOT NULL,
    version       TEXT    NOT NULL,
    started_at_ms INTEGER NOT NULL,
    seen_at_ms    INTEGER NOT NULL,
    stats         TEXT    NOT NULL DEFAULT '{}'
);

-- Purges by hand (a package, an entry): replicas drop what they remember of the
-- repository when their heartbeat sees a newer id.
CREATE TABLE purges (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    repository TEXT    NOT NULL,
    package    TEXT,
    key        TEXT,
    at_ms      INTEGER NOT NULL
);

-- Recent job failures with their reason (job_runs keeps only each job's last run).
CREATE TABLE job_failures (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    name    TEXT    NOT NULL,
    run_id  INTEGER NOT NULL,
    holder  TEXT    NOT NULL,
    at_ms   INTEGER NOT NULL,
    reason  TEXT    NOT NULL
);

-- Every mirror run, scheduled, from `proxy mirror` or from the API: progress, outcome,
-- and a cancellation request the running replica sees at its next progress write.
CREATE TABLE mirror_runs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    name             TEXT    NOT NULL,
    origin           TEXT    NOT NULL CHECK (origin IN ('schedule', 'cli', 'api')),
    holder           TEXT    NOT NULL,
    request          TEXT    NOT NULL DEFAULT '{}',
    state            TEXT    NOT NULL
        CHECK (state IN ('running', 'ok', 'failed', 'cancelled')),
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    planned          INTEGER NOT NULL DEFAULT 0,
    fetched          INTEGER NOT NULL DEFAULT 0,
    cached           INTEGER NOT NULL DEFAULT 0,
    missing          INTEGER NOT NULL DEFAULT 0,
    failed           INTEGER NOT NULL DEFAULT 0,
    skipped          INTEGER NOT NULL DEFAULT 0,
    bytes            INTEGER NOT NULL DEFAULT 0,
    started_at_ms    INTEGER NOT NULL,
    updated_at_ms    INTEGER NOT NULL,
    finished_at_ms   INTEGER,
    error            TEXT
);

-- Entries: (repository, key) -> blob. Times are Unix milliseconds (one clock: this machine's).
CREATE TABLE entries (
    repository     TEXT    NOT NULL,
    key            TEXT    NOT NULL,
    kind           TEXT    NOT NULL CHECK (kind IN ('immutable', 'metadata', 'negative', 'hosted')),
    sha256         TEXT,
    size           INTEGER NOT NULL DEFAULT 0,
    content_type   TEXT,
    etag           TEXT,
    last_modified  TEXT,
    digests        TEXT    NOT NULL DEFAULT '{}',
    fetched_at_ms  INTEGER NOT NULL,
    expires_at_ms  INTEGER,
    last_access_ms INTEGER NOT NULL,
    PRIMARY KEY (repository, key)
);
CREATE INDEX entries_by_last_access ON entries (repository, last_access_ms);
CREATE INDEX entries_by_sha256 ON entries (sha256);
CREATE INDEX entries_negative_expiry ON entries (expires_at_ms) WHERE kind = 'negative';

-- Files that an index page this proxy fetched listed: the only URLs a file request can reach.
CREATE TABLE links (
    repository     TEXT    NOT NULL,
    key            TEXT    NOT NULL,
    url            TEXT    NOT NULL,
    digests        TEXT    NOT NULL DEFAULT '{}',
    size           INTEGER,
    recorded_at_ms INTEGER NOT NULL,
    PRIMARY KEY (repository, key)
);

-- Fetch leases (docs/architecture.md, "Fetch leases"). The fence comes from lease_fences' AUTOINCREMENT, which
-- never reuses a value even after rows are deleted, so it stays monotonic after purges.
CREATE TABLE fetch_leases (
    key         TEXT    PRIMARY KEY,
    holder      TEXT    NOT NULL,
    fence       INTEGER NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('fetching', 'done', 'failed', 'released')),
    acquired_at INTEGER NOT NULL,
    renewed_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    CHECK (expires_at >= acquired_at)
);
CREATE INDEX fetch_leases_by_expiry ON fetch_leases (expires_at);
CREATE TABLE lease_fences (id INTEGER PRIMARY KEY AUTOINCREMENT);

-- Background jobs: one pass at a time per job, one run per interval per schedule.
CREATE TABLE job_locks (
    name          TEXT    PRIMARY KEY,
    holder        TEXT    NOT NULL,
    expires_at_ms INTEGER NOT NULL
);
CREATE TABLE job_runs (
    name                   TEXT    PRIMARY KEY,
    run_id                 INTEGER NOT NULL,
    started_at_ms          INTEGER NOT NULL,
    previous_started_at_ms INTEGER,
    holder                 TEXT    NOT NULL
);

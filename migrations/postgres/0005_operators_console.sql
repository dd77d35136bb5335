-- The operators' console and admin API (docs/architecture.md, "Operating: console, API
-- and logs").

-- The database's clock in Unix ms, as SQLite's clock_ms(): the tables below keep times
-- as such numbers in both dialects.
CREATE FUNCTION clock_ms() RETURNS bigint LANGUAGE sql VOLATILE
    AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;

-- Which package and version an entry belongs to (the format says, when it is stored),
-- and the upstream URL its body came from. The index serves browsing and searching a
-- repository by package name (byte order: prefix ranges and keyset pages agree), and
-- purging a package, on a catalog of millions.
ALTER TABLE entries
    ADD COLUMN package      text,
    ADD COLUMN version      text,
    ADD COLUMN upstream_url text;
CREATE INDEX entries_by_package
    ON entries (repository, package COLLATE "C", key COLLATE "C") WHERE package IS NOT NULL;

-- Repositories whose entries stored before the package column existed have all been
-- given their package (the "packages" job does it once per repository).
CREATE TABLE package_backfills (repository text PRIMARY KEY, done_at_ms bigint NOT NULL);

-- Progress of a download, written by the holder with each renewal (no extra statement).
ALTER TABLE fetch_leases
    ADD COLUMN written bigint,
    ADD COLUMN waiters integer;

-- One row per replica (lease holder), written by its heartbeat; fleet-wide numbers are
-- the sums over these rows.
CREATE TABLE replicas (
    holder        text    PRIMARY KEY,
    host          text    NOT NULL,
    pid           integer NOT NULL,
    url           text    NOT NULL,
    version       text    NOT NULL,
    started_at_ms bigint  NOT NULL,
    seen_at_ms    bigint  NOT NULL,
    stats         jsonb   NOT NULL DEFAULT '{}'
);

-- Purges by hand: replicas drop what they remember of the repository when their
-- heartbeat sees a newer id.
CREATE TABLE purges (
    id         bigserial PRIMARY KEY,
    repository text      NOT NULL,
    package    text,
    key        text,
    at_ms      bigint    NOT NULL
);

-- Recent job failures with their reason (job_runs keeps only each job's last run).
CREATE TABLE job_failures (
    id      bigserial PRIMARY KEY,
    name    text      NOT NULL,
    run_id  bigint    NOT NULL,
    holder  text      NOT NULL,
    at_ms   bigint    NOT NULL,
    reason  text      NOT NULL
);

-- Every mirror run, scheduled, from `proxy mirror` or from the API.
CREATE TABLE mirror_runs (
    id               bigserial PRIMARY KEY,
    name             text      NOT NULL,
    origin           text      NOT NULL CHECK (origin IN ('schedule', 'cli', 'api')),
    holder           text      NOT NULL,
    request          jsonb     NOT NULL DEFAULT '{}',
    state            text      NOT NULL
        CHECK (state IN ('running', 'ok', 'failed', 'cancelled')),
    cancel_requested boolean   NOT NULL DEFAULT false,
    planned          bigint    NOT NULL DEFAULT 0,
    fetched          bigint    NOT NULL DEFAULT 0,
    cached           bigint    NOT NULL DEFAULT 0,
    missing          bigint    NOT NULL DEFAULT 0,
    failed           bigint    NOT NULL DEFAULT 0,
    skipped          bigint    NOT NULL DEFAULT 0,
    bytes            bigint    NOT NULL DEFAULT 0,
    started_at_ms    bigint    NOT NULL,
    updated_at_ms    bigint    NOT NULL,
    finished_at_ms   bigint,
    error            text
);

-- Entries: (repository, key) -> blob. Entry times are Unix milliseconds from the writer's
-- clock (freshness tolerates skew); lease times use the database clock only.
CREATE TABLE entries (
    repository     text    NOT NULL,
    key            text    NOT NULL,
    kind           text    NOT NULL CHECK (kind IN ('immutable', 'metadata', 'negative', 'hosted')),
    sha256         text,
    size           bigint  NOT NULL DEFAULT 0,
    content_type   text,
    etag           text,
    last_modified  text,
    digests        jsonb   NOT NULL DEFAULT '{}',
    fetched_at_ms  bigint  NOT NULL,
    expires_at_ms  bigint,
    last_access_ms bigint  NOT NULL,
    PRIMARY KEY (repository, key)
);
CREATE INDEX entries_by_last_access ON entries (repository, last_access_ms);
CREATE INDEX entries_by_sha256 ON entries (sha256);
CREATE INDEX entries_negative_expiry ON entries (expires_at_ms) WHERE kind = 'negative';

-- Files that an index page this proxy fetched listed: the only URLs a file request can reach.
CREATE TABLE links (
    repository     text   NOT NULL,
    key            text   NOT NULL,
    url            text   NOT NULL,
    digests        jsonb  NOT NULL DEFAULT '{}',
    size           bigint,
    recorded_at_ms bigint NOT NULL,
    PRIMARY KEY (repository, key)
);

-- Fetch leases (docs/architecture.md, "Fetch leases"). Fences come from one global sequence: they grow on every
-- claim, re-entrant ones included, and stay monotonic after rows are purged.
CREATE SEQUENCE fetch_lease_fence;
CREATE TABLE fetch_leases (
    key         text        PRIMARY KEY,
    holder      text        NOT NULL,
    fence       bigint      NOT NULL,
    state       text        NOT NULL CHECK (state IN ('fetching', 'done', 'failed', 'released')),
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    CHECK (expires_at >= acquired_at)
);
CREATE INDEX fetch_leases_by_expiry ON fetch_leases (expires_at);

-- Every change of custody or outcome is announced; waiters poll as well, so a lost
-- notification only costs latency. Renewals (same fence and state) stay quiet.
CREATE FUNCTION fetch_leases_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('proxy_fetch_leases', NEW.key);
    RETURN NEW;
END
$$;
CREATE TRIGGER fetch_leases_notify_insert AFTER INSERT ON fetch_leases
    FOR EACH ROW EXECUTE FUNCTION fetch_leases_notify();
CREATE TRIGGER fetch_leases_notify_update AFTER UPDATE ON fetch_leases
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.fence IS DISTINCT FROM NEW.fence)
    EXECUTE FUNCTION fetch_leases_notify();

-- Schedules: the last start of each job, so it runs once per interval for the fleet.
CREATE TABLE job_runs (
    name                text        PRIMARY KEY,
    run_id              bigint      NOT NULL,
    started_at          timestamptz NOT NULL,
    previous_started_at timestamptz,
    holder              text        NOT NULL
);

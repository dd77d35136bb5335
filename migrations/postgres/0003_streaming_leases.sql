-- Streaming across replicas (docs/architecture.md, "Streaming across replicas"): the
-- holder of a fetch lease announces the temp file it is writing on the shared volume,
-- with the answer's type and length, so waiting replicas serve it as it grows.
ALTER TABLE fetch_leases
    ADD COLUMN stream_file   text,
    ADD COLUMN stream_type   text,
    ADD COLUMN stream_length bigint;

-- An announcement wakes the waiters at once, like a change of state or fence.
DROP TRIGGER fetch_leases_notify_update ON fetch_leases;
CREATE TRIGGER fetch_leases_notify_update AFTER UPDATE ON fetch_leases
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.fence IS DISTINCT FROM NEW.fence
          OR OLD.stream_file IS DISTINCT FROM NEW.stream_file)
    EXECUTE FUNCTION fetch_leases_notify();

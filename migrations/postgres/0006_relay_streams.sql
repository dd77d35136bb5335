-- Streaming across replicas on object storage (docs/architecture.md, "Streaming across
-- replicas on object storage"): with no shared volume, the holder of a fetch lease
-- announces the internal URL of its relay and a random token for this download.
ALTER TABLE fetch_leases
    ADD COLUMN stream_relay text,
    ADD COLUMN stream_token text;

-- The notification carries the relay as it carries the file (migration 0004): a waiter
-- follows it without reading the row again.
CREATE OR REPLACE FUNCTION fetch_leases_notify() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    payload text := json_build_object(
        'key', NEW.key, 'holder', NEW.holder, 'fence', NEW.fence, 'state', NEW.state,
        'file', NEW.stream_file, 'type', NEW.stream_type, 'length', NEW.stream_length,
        'relay', NEW.stream_relay, 'token', NEW.stream_token
    )::text;
BEGIN
    IF octet_length(payload) < 8000 THEN
        PERFORM pg_notify('proxy_fetch_leases', payload);
    END IF;
    RETURN NEW;
END
$$;

-- A relay announcement wakes the waiters at once, like a temp file's name.
DROP TRIGGER fetch_leases_notify_update ON fetch_leases;
CREATE TRIGGER fetch_leases_notify_update AFTER UPDATE ON fetch_leases
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.fence IS DISTINCT FROM NEW.fence
          OR OLD.stream_file IS DISTINCT FROM NEW.stream_file
          OR OLD.stream_relay IS DISTINCT FROM NEW.stream_relay)
    EXECUTE FUNCTION fetch_leases_notify();

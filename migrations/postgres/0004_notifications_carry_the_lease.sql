-- Lease notifications carry the row (docs/architecture.md, "Fetch leases"): a waiter
-- learns of an announced stream, or of the outcome, without reading the row again.
-- pg_notify refuses a payload of 8000 bytes or more (it would fail the claim or the
-- release itself): a lease that long (a very long key) notifies nobody, and its
-- waiters go by polling.
CREATE OR REPLACE FUNCTION fetch_leases_notify() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    payload text := json_build_object(
        'key', NEW.key, 'holder', NEW.holder, 'fence', NEW.fence, 'state', NEW.state,
        'file', NEW.stream_file, 'type', NEW.stream_type, 'length', NEW.stream_length
    )::text;
BEGIN
    IF octet_length(payload) < 8000 THEN
        PERFORM pg_notify('proxy_fetch_leases', payload);
    END IF;
    RETURN NEW;
END
$$;

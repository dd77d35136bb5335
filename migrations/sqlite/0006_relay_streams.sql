-- Streaming across processes on object storage (docs/architecture.md, "Streaming across
-- replicas on object storage"): the holder announces its relay's URL and a random token
-- for this download instead of a temp file on a shared volume.
ALTER TABLE fetch_leases ADD COLUMN stream_relay TEXT;
ALTER TABLE fetch_leases ADD COLUMN stream_token TEXT;
